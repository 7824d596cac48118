package rmm

import (
	"fmt"
	"runtime"
	"sync"
	"testing"
)

// BenchmarkGPUVMMMapParallel: the driver calls a growth of an expandable pool makes per chunk
// (cuMemCreate, cuMemMap and cuMemSetAccess of one 2 MiB handle, then cuMemUnmap and
// cuMemRelease), issued from g goroutines at once, each on its own OS thread and into its own
// part of one reservation, 64 chunks each. ns/chunk is the wall time per chunk mapped and taken
// down (run with -benchtime 1024x or more): it tells whether the driver serves these calls side
// by side (ns/chunk falling with g) or one at a time.
func BenchmarkGPUVMMMapParallel(b *testing.B) {
	if !onGPU() {
		b.Skip("needs a GPU")
	}
	vm, err := newDeviceVMM(0)
	if err != nil {
		b.Skip(err)
	}
	gran := vm.granularity()
	const perThread = 64
	for _, g := range []int{1, 2, 4, 8} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			base, err := vm.reserve(g * perThread * gran)
			if err != nil {
				b.Fatal(err)
			}
			defer vm.free(base, g*perThread*gran)
			b.ResetTimer()
			done := 0
			for ; done < b.N; done += g * perThread {
				var wg sync.WaitGroup
				errs := make([]error, g)
				for w := range g {
					wg.Add(1)
					go func() {
						defer wg.Done()
						runtime.LockOSThread()
						defer runtime.UnlockOSThread()
						at := base + DevicePtr(w*perThread*gran)
						hs := make([]vmmHandle, 0, perThread)
						for i := range perThread {
							h, err := vm.create(gran)
							if err == nil {
								err = vm.mapAt(at+DevicePtr(i*gran), gran, h)
							}
							if err == nil {
								err = vm.setAccess(at+DevicePtr(i*gran), gran)
							}
							if err != nil {
								errs[w] = err
								return
							}
							hs = append(hs, h)
						}
						if err := vm.unmap(at, perThread*gran); err != nil {
							errs[w] = err
						}
						for _, h := range hs {
							vm.release(h)
						}
					}()
				}
				wg.Wait()
				for _, err := range errs {
					if err != nil {
						b.Fatal(err)
					}
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(done), "ns/chunk")
		})
	}
}
