package rmm

import (
	"sync/atomic"
	"testing"
)

// adpNullUpstream hands out fresh, disjoint 256-aligned address ranges (one atomic add) and takes frees without
// looking: what is left of a benchmark over it is the adaptor's own cost.
type adpNullUpstream struct{ next atomic.Uintptr }

func (u *adpNullUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	if n == 0 {
		return 0, nil
	}
	n = roundUp(n)
	return DevicePtr(u.next.Add(uintptr(n)) - uintptr(n) + 1<<40), nil
}

func (u *adpNullUpstream) Deallocate(DevicePtr, int, StreamView) error { return nil }

// BenchmarkAdaptors measures one Allocate+Deallocate pair of 4 KiB through each adaptor over an
// upstream that does nothing, on one goroutine and from all of them.
func BenchmarkAdaptors(b *testing.B) {
	type maker func(up MemoryResource) MemoryResource
	adaptors := []struct {
		name string
		make maker
	}{
		{"upstream", func(up MemoryResource) MemoryResource { return up }},
		{"statistics", func(up MemoryResource) MemoryResource { r, _ := NewStatisticsResourceAdaptor(up); return r }},
		{"tracking", func(up MemoryResource) MemoryResource { r, _ := NewTrackingResourceAdaptor(up, nil); return r }},
		{"tracking-stacks", func(up MemoryResource) MemoryResource {
			r, _ := NewTrackingResourceAdaptor(up, &TrackingOptions{CaptureStacks: true})
			return r
		}},
		{"memory-profile", func(up MemoryResource) MemoryResource { r, _ := NewMemoryProfileResourceAdaptor(up, nil); return r }},
		{"limiting", func(up MemoryResource) MemoryResource { r, _ := NewLimitingResourceAdaptor(up, 1<<62, nil); return r }},
		{"aligned-4096", func(up MemoryResource) MemoryResource {
			r, _ := NewAlignedResourceAdaptor(up, &AlignedOptions{Alignment: 4096})
			return r
		}},
		{"failure-callback", func(up MemoryResource) MemoryResource {
			r, _ := NewFailureCallbackResourceAdaptor(up, func(int, error) bool { return false }, nil)
			return r
		}},
		{"prefetch", func(up MemoryResource) MemoryResource { r, _ := NewPrefetchResourceAdaptor(up); return r }},
		{"threadsafe", func(up MemoryResource) MemoryResource { r, _ := NewThreadSafeResourceAdaptor(up); return r }},
	}
	const n = 4096
	for _, a := range adaptors {
		b.Run(a.name, func(b *testing.B) {
			mr := a.make(&adpNullUpstream{})
			b.ReportAllocs()
			for b.Loop() {
				p, err := mr.Allocate(n, DefaultStream)
				if err != nil {
					b.Fatal(err)
				}
				if err := mr.Deallocate(p, n, DefaultStream); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(a.name+"-parallel", func(b *testing.B) {
			mr := a.make(&adpNullUpstream{})
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					p, err := mr.Allocate(n, DefaultStream)
					if err != nil {
						b.Error(err)
						return
					}
					if err := mr.Deallocate(p, n, DefaultStream); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
