package rmm

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// TestBlockSize keeps a pool block at 80 bytes (see block): the runtime's size classes go 80, 96,
// 112, and W2 below 1 MiB slowed by 11-15% at 96 bytes.
func TestBlockSize(t *testing.T) {
	require.EqualValues(t, 80, unsafe.Sizeof(block{}))
}

// TestBlockReq: an allocated block keeps the size asked as its difference from its size, which
// must be that size rounded up to Alignment.
func TestBlockReq(t *testing.T) {
	b := &block{size: 4 * Alignment}
	for _, n := range []int{3*Alignment + 1, 4*Alignment - 1, 4 * Alignment} {
		b.setReq(n)
		require.Equal(t, n, b.req())
	}
	require.Panics(t, func() { b.setReq(3 * Alignment) }, "a request a whole Alignment below the block")
	require.Panics(t, func() { b.setReq(4*Alignment + 1) }, "a request above the block")
	require.Equal(t, 4*Alignment, b.req(), "a refused request changes nothing")
}

// freelistCheck verifies l (freeList.check) and that it holds exactly want, in (size, address)
// order.
func freelistCheck(t *testing.T, l *freeList, want []*block) {
	t.Helper()
	got := []*block{}
	require.NoError(t, l.check(func(b *block) error {
		if b.list != l {
			return fmt.Errorf("block %#x names another list", uintptr(b.addr))
		}
		got = append(got, b)
		return nil
	}))
	require.Equal(t, append([]*block{}, want...), got)
	each := []*block{}
	l.each(func(b *block) { each = append(each, b) })
	require.Equal(t, got, each)
}

// The free list against a sorted-slice model: insertions, removals, best fit (smallest size,
// lowest address among equals) and the largest block, after every step, with sizes that share a
// class, sizes in neighbouring classes and levels, sizes off the 256-byte grid and huge ones.
func TestFreelistAgainstModel(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	r := rand.New(rand.NewPCG(3, 5))
	l := &freeList{rng: 1}
	var model []*block // sorted by (size, address)
	cmp := func(a, b *block) int {
		switch {
		case a.less(b):
			return -1
		case b.less(a):
			return 1
		}
		return 0
	}
	used := map[DevicePtr]bool{}
	for step := range shortOrLong(2000, 5000) {
		if len(model) == 0 || r.IntN(5) < 3 {
			a := DevicePtr(r.IntN(1<<16)+1) << 8
			if used[a] {
				continue
			}
			used[a] = true
			b := &block{addr: a, size: freelistTestSize(r), free: true}
			l.insert(b)
			i, _ := slices.BinarySearchFunc(model, b, cmp)
			model = slices.Insert(model, i, b)
		} else {
			i := r.IntN(len(model))
			b := model[i]
			l.remove(b)
			require.Nil(t, b.list)
			require.Nil(t, b.parent)
			delete(used, b.addr)
			model = slices.Delete(model, i, i+1)
		}
		freelistCheck(t, l, model)
		n := freelistTestSize(r)
		var want *block
		for _, b := range model {
			if b.size >= n {
				want = b
				break
			}
		}
		require.Same(t, want, l.bestFit(n), "bestFit(%d) at step %d", n, step)
		var largest *block
		if len(model) > 0 {
			largest = model[len(model)-1]
		}
		require.Same(t, largest, l.largest())
	}
}

// freelistTestSize draws a block size: often a few steps of 256 bytes (equal sizes, level 0),
// else sizes around and across class and level boundaries up to 2^45, some off the grid.
func freelistTestSize(r *rand.Rand) int {
	switch r.IntN(4) {
	case 0:
		return (r.IntN(8) + 1) << 8
	case 1:
		return r.IntN(1<<16) + 1
	case 2:
		e := r.IntN(38) + 8
		return 1<<e + (r.IntN(5)-2)<<(e-6) + r.IntN(3)<<8
	}
	return r.IntN(1<<45) + 1
}

// freeClass is monotone in the size and puts the boundaries where the doc says.
func TestFreelistClasses(t *testing.T) {
	order := func(size int) int {
		l, c := freeClass(size)
		return l*freeSubs + c
	}
	require.Equal(t, 0, order(1))
	require.Equal(t, 0, order(255))
	require.Equal(t, 1, order(256))
	require.Equal(t, 63, order(64*256-1))
	l, c := freeClass(64 * 256)
	require.Equal(t, [2]int{1, 0}, [2]int{l, c})
	l, c = freeClass(65 * 256)
	require.Equal(t, [2]int{1, 1}, [2]int{l, c})
	l, c = freeClass(128 * 256)
	require.Equal(t, [2]int{2, 0}, [2]int{l, c})
	l, c = freeClass(math.MaxInt)
	require.Equal(t, [2]int{freeLevels - 1, freeSubs - 1}, [2]int{l, c})
	r := rand.New(rand.NewPCG(1, 2))
	for range 100000 {
		a, b := freelistTestSize(r), freelistTestSize(r)
		if a > b {
			a, b = b, a
		}
		require.LessOrEqual(t, order(a), order(b), "sizes %d and %d", a, b)
	}
}

// eachAtLeast visits every block of at least n bytes, in (size, address) order.
func TestFreeListEachAtLeast(t *testing.T) {
	l := &freeList{rng: 1}
	sizes := []int{256, 4096, 16 << 10, 1 << 20, 2<<20 - 256, 2 << 20, 2<<20 + 256, 3 << 20, 64 << 20, 1 << 30}
	for i, s := range sizes {
		l.insert(&block{addr: DevicePtr((i + 1) << 32), size: s, free: true})
	}
	for _, n := range []int{256, 2 << 20, 2<<20 + 1, 64 << 20, 2 << 30} {
		var all, got []int
		l.each(func(b *block) {
			if b.size >= n {
				all = append(all, b.size)
			}
		})
		l.eachAtLeast(n, func(b *block) {
			if b.size >= n {
				got = append(got, b.size)
			}
		})
		if !slices.Equal(all, got) {
			t.Fatalf("n %d: each %v, eachAtLeast %v", n, all, got)
		}
	}
}
