package rmmtest_test

import (
	"fmt"
	"sort"
	"sync"
	"testing"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/rmmtest"
)

// bumpSub is a sub-allocator that takes one 256 MiB block from its upstream and carves it by
// first fit over a sorted free list. It detects pointers never handed out, double frees and
// wrong sizes, EXCEPT for one fault chosen by kind.
type bumpSub struct {
	kind string
	up   rmm.MemoryResource

	mu   sync.Mutex
	base rmm.DevicePtr
	size int
	free []span // sorted by address, coalesced
	live map[rmm.DevicePtr]int
}

type span struct {
	p rmm.DevicePtr
	n int
}

const bumpSize = 2 << 30

func newBumpSub(kind string) func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
	return func(up rmm.MemoryResource) (rmm.MemoryResource, error) {
		return &bumpSub{kind: kind, up: up, live: map[rmm.DevicePtr]int{}}, nil
	}
}

func roundUp(n int) int { return (n + 255) &^ 255 }

func (b *bumpSub) lock() {
	if b.kind != "racy" {
		b.mu.Lock()
	}
}
func (b *bumpSub) unlock() {
	if b.kind != "racy" {
		b.mu.Unlock()
	}
}

func (b *bumpSub) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	if n < 0 {
		return 0, fmt.Errorf("%w: negative", rmm.ErrInvalidArgument)
	}
	if n == 0 {
		return 0, nil
	}
	b.lock()
	defer b.unlock()
	if b.base == 0 {
		p, err := b.up.Allocate(bumpSize, s)
		if err != nil {
			return 0, err
		}
		b.base, b.size = p, bumpSize
		b.free = []span{{p, bumpSize}}
	}
	r := roundUp(n)
	for i, f := range b.free {
		if f.n >= r {
			p := f.p
			if f.n == r {
				b.free = append(b.free[:i], b.free[i+1:]...)
			} else {
				b.free[i] = span{f.p + rmm.DevicePtr(r), f.n - r}
			}
			b.live[p] = n
			return p, nil
		}
	}
	return 0, fmt.Errorf("%w: bumpSub: %d bytes", rmm.ErrOutOfMemory, n)
}

func (b *bumpSub) insertFree(p rmm.DevicePtr, n int) {
	i := sort.Search(len(b.free), func(i int) bool { return b.free[i].p > p })
	b.free = append(b.free, span{})
	copy(b.free[i+1:], b.free[i:])
	b.free[i] = span{p, n}
	// coalesce
	out := b.free[:0]
	for _, f := range b.free {
		if len(out) > 0 && out[len(out)-1].p+rmm.DevicePtr(out[len(out)-1].n) == f.p {
			out[len(out)-1].n += f.n
			continue
		}
		out = append(out, f)
	}
	b.free = out
}

func (b *bumpSub) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error {
	if p == 0 {
		return nil
	}
	b.lock()
	defer b.unlock()
	size, ok := b.live[p]
	if !ok && b.kind == "interiorAligned" && p%256 == 0 {
		// Finds the live block containing p and frees it: an aligned interior pointer frees
		// the whole block.
		for q, sz := range b.live {
			if p > q && p < q+rmm.DevicePtr(sz) && n == sz {
				delete(b.live, q)
				b.insertFree(q, roundUp(sz))
				return nil
			}
		}
	}
	if !ok && b.kind == "freeSpaceNoop" && p%256 == 0 && p >= b.base && p < b.base+rmm.DevicePtr(b.size) {
		inLive := false
		for q, sz := range b.live {
			if p > q && p < q+rmm.DevicePtr(sz) {
				inLive = true
			}
		}
		if !inLive {
			return nil // "already free": silently accepted
		}
	}
	if !ok {
		return fmt.Errorf("%w: bumpSub: %#x not live", rmm.ErrInvalidFree, uintptr(p))
	}
	if b.kind == "roundedSize" {
		if roundUp(size) != roundUp(n) {
			return fmt.Errorf("%w: bumpSub: size", rmm.ErrInvalidFree)
		}
	} else if size != n {
		return fmt.Errorf("%w: bumpSub: size", rmm.ErrInvalidFree)
	}
	delete(b.live, p)
	b.insertFree(p, roundUp(size))
	return nil
}

func (b *bumpSub) Upstream() rmm.MemoryResource { return b.up }
func (b *bumpSub) Access() rmm.Access           { return rmm.AccessOf(b.up) }

func (b *bumpSub) Release() error {
	b.lock()
	defer b.unlock()
	if len(b.live) == 0 && b.base != 0 {
		if err := b.up.Deallocate(b.base, b.size, rmm.DefaultStream); err != nil {
			return err
		}
		b.base, b.free = 0, nil
	}
	return nil
}

// A first-fit resource that, given an aligned pointer inside a live block, frees that block:
// the suite's interior-pointer frees must catch it on every seed. Over an address-only upstream,
// so that the broken resource's early free touches no real memory.
func TestInteriorAlignedFreeCaught(t *testing.T) {
	for seed := int64(1); seed <= 20; seed++ {
		err := rmmtest.Check(newBumpSub("interiorAligned"), &rmmtest.Options{DetectsInvalidFree: true, IgnoresStreams: true, Seed: seed,
			Upstream: func() rmm.MemoryResource { sim, _ := rmm.NewSimulatedMemoryResource(1 << 40); return sim }})
		if err == nil {
			t.Errorf("seed %d: the suite accepted a resource that frees a live block for an aligned interior pointer", seed)
		}
	}
	// The same resource without the fault passes.
	if err := rmmtest.Check(newBumpSub(""), &rmmtest.Options{DetectsInvalidFree: true, IgnoresStreams: true,
		Upstream: func() rmm.MemoryResource { sim, _ := rmm.NewSimulatedMemoryResource(1 << 40); return sim }}); err != nil {
		t.Fatalf("the correct resource failed: %v", err)
	}
}
