package rmm

import (
	"errors"
	"fmt"
	"math/rand"
	"strings"
	"sync"
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// vmmTestHost returns a hostVMM with the page size as granularity (4096 bytes on x86-64), or
// skips where hostVMM is not supported.
func vmmTestHost(t *testing.T, limit int) (*hostVMM, int) {
	t.Helper()
	g := syscall.Getpagesize()
	v, err := newHostVMM(g, limit)
	if errors.Is(err, ErrNotSupported) {
		t.Skipf("hostVMM: %v", err)
	}
	require.NoError(t, err)
	require.Equal(t, g, v.granularity())
	return v, g
}

// vmmTestFill writes byte i+seed at offset i of [p, p+n).
func vmmTestFill(p DevicePtr, n int, seed byte) {
	b := hostBytes(p, n)
	for i := range b {
		b[i] = byte(i) + seed
	}
}

// vmmTestCheck checks what vmmTestFill wrote.
func vmmTestCheck(t *testing.T, p DevicePtr, n int, seed byte) {
	t.Helper()
	b := hostBytes(p, n)
	for i := range b {
		if b[i] != byte(i)+seed {
			t.Fatalf("byte %d at %#x is %d, want %d", i, uintptr(p)+uintptr(i), b[i], byte(i)+seed)
		}
	}
}

func TestVMMHostConstructor(t *testing.T) {
	page := syscall.Getpagesize()
	if _, err := newHostVMM(page, 0); errors.Is(err, ErrNotSupported) {
		t.Skipf("hostVMM: %v", err)
	}
	for _, g := range []int{0, -page, page / 2, page + 1, 3*page - 1} {
		_, err := newHostVMM(g, 0)
		require.ErrorIs(t, err, ErrInvalidArgument, "granularity %d", g)
	}
	_, err := newHostVMM(page, -1)
	require.ErrorIs(t, err, ErrInvalidArgument)
	v, err := newHostVMM(4*page, 8*page)
	require.NoError(t, err)
	require.Equal(t, 4*page, v.granularity())
}

// Two separately created chunks mapped back to back form one range that is written and read
// across the seam; unmapping drops the contents.
func TestVMMHostRoundTrip(t *testing.T) {
	v, g := vmmTestHost(t, 0)
	base, err := v.reserve(16 * g)
	require.NoError(t, err)
	require.Zero(t, uintptr(base)%uintptr(g))

	h1, err := v.create(2 * g)
	require.NoError(t, err)
	h2, err := v.create(3 * g)
	require.NoError(t, err)
	require.NotEqual(t, h1, h2)
	require.NoError(t, v.mapAt(base, 2*g, h1))
	require.NoError(t, v.mapAt(base+DevicePtr(2*g), 3*g, h2))
	require.True(t, v.mapped(base))
	require.True(t, v.mapped(base+DevicePtr(5*g-1)))
	require.False(t, v.mapped(base+DevicePtr(5*g)))
	require.False(t, v.accessible(base), "a mapping starts with no access")

	// One setAccess over both mappings.
	require.NoError(t, v.setAccess(base, 5*g))
	require.True(t, v.accessible(base))
	require.True(t, v.accessible(base+DevicePtr(4*g)))
	vmmTestFill(base, 5*g, 7)
	vmmTestCheck(t, base, 5*g, 7)
	seam := base + DevicePtr(2*g) - 100
	vmmTestFill(seam, 200, 99)
	vmmTestCheck(t, seam, 200, 99)
	vmmTestCheck(t, base, 2*g-100, 7)
	require.Equal(t, vmmStats{Physical: 5 * g, Handles: 2, Mappings: 2, Reservations: 1, Creates: 2, Maps: 2}, v.stats())

	// Unmapping the first chunk leaves the second and its contents.
	require.NoError(t, v.unmap(base, 2*g))
	require.False(t, v.mapped(base))
	require.True(t, v.mapped(base+DevicePtr(2*g)))
	require.True(t, v.accessible(base+DevicePtr(2*g)))
	b := hostBytes(base+DevicePtr(2*g), 100)
	for i := range b {
		require.Equal(t, byte(i)+99+200-100, b[i])
	}

	// Mapped again (the same handle, still live), it starts with no access and reads zeros.
	require.NoError(t, v.mapAt(base, 2*g, h1))
	require.False(t, v.accessible(base))
	require.NoError(t, v.setAccess(base, 2*g))
	require.Equal(t, make([]byte, 2*g), hostBytes(base, 2*g))

	require.NoError(t, v.unmap(base, 5*g))
	require.Equal(t, 0, v.stats().Mappings)
	require.NoError(t, v.release(h1))
	require.NoError(t, v.release(h2))
	require.NoError(t, v.free(base, 16*g))
	require.Equal(t, vmmStats{Creates: 2, Releases: 2, Maps: 3, Unmaps: 3}, v.stats())
}

// A granularity above the page size: reservations are aligned to it.
func TestVMMHostLargeGranularity(t *testing.T) {
	page := syscall.Getpagesize()
	g := 2 << 20
	if g%page != 0 {
		g = 4 * page
	}
	v, err := newHostVMM(g, 0)
	if errors.Is(err, ErrNotSupported) {
		t.Skipf("hostVMM: %v", err)
	}
	require.NoError(t, err)
	var bases []DevicePtr
	for i := 1; i <= 4; i++ {
		p, err := v.reserve(i * g)
		require.NoError(t, err)
		require.Zero(t, uintptr(p)%uintptr(g), "base %#x", uintptr(p))
		bases = append(bases, p)
	}
	h, err := v.create(g)
	require.NoError(t, err)
	require.NoError(t, v.mapAt(bases[3]+DevicePtr(3*g), g, h))
	require.NoError(t, v.setAccess(bases[3]+DevicePtr(3*g), g))
	vmmTestFill(bases[3]+DevicePtr(3*g), g, 3)
	vmmTestCheck(t, bases[3]+DevicePtr(3*g), g, 3)
	require.ErrorIs(t, v.free(bases[3], 4*g), ErrInvalidArgument)
	require.NoError(t, v.unmap(bases[3]+DevicePtr(3*g), g))
	require.NoError(t, v.release(h))
	for i, p := range bases {
		require.NoError(t, v.free(p, (i+1)*g))
	}
	require.Equal(t, 0, v.stats().Reservations)
}

// Every misuse is ErrInvalidArgument naming the operation and the address, and changes nothing.
func TestVMMHostMisuse(t *testing.T) {
	v, g := vmmTestHost(t, 0)
	base, err := v.reserve(8 * g)
	require.NoError(t, err)
	other, err := v.reserve(4 * g)
	require.NoError(t, err)
	at := func(k int) DevicePtr { return base + DevicePtr(k*g) }
	h2, err := v.create(2 * g) // mapped at granules 2..3
	require.NoError(t, err)
	require.NoError(t, v.mapAt(at(2), 2*g, h2))
	h1, err := v.create(g) // mapped at granule 4
	require.NoError(t, err)
	require.NoError(t, v.mapAt(at(4), g, h1))
	hFree, err := v.create(g) // not mapped
	require.NoError(t, err)
	hGone, err := v.create(g)
	require.NoError(t, err)
	require.NoError(t, v.release(hGone))
	hMappedElsewhere, err := v.create(g)
	require.NoError(t, err)
	require.NoError(t, v.mapAt(other, g, hMappedElsewhere))
	before := v.stats()

	hex := func(p DevicePtr) string { return fmt.Sprintf("%#x", uintptr(p)) }
	for _, c := range []struct {
		name string
		err  error
		want string // in the message
	}{
		{"reserve 0", ignoreHandle(v.reserve(0)), "reserve"},
		{"reserve negative", ignoreHandle(v.reserve(-g)), "reserve"},
		{"reserve unaligned size", ignoreHandle(v.reserve(g + 1)), "reserve"},
		{"create 0", ignoreHandle(v.create(0)), "create"},
		{"create unaligned", ignoreHandle(v.create(g / 2)), "create"},
		{"create negative", ignoreHandle(v.create(-g)), "create"},
		{"map unaligned address", v.mapAt(at(0)+1, g, hFree), "mapAt"},
		{"map null", v.mapAt(0, g, hFree), "mapAt"},
		{"map unaligned size", v.mapAt(at(0), g+1, hFree), "mapAt"},
		{"map part of a handle", v.mapAt(at(0), g, h2), hex(at(0))},
		{"map more than the handle", v.mapAt(at(0), 2*g, hFree), hex(at(0))},
		{"map outside a reservation", v.mapAt(at(8)+DevicePtr(1<<40), g, hFree), "not inside a reservation"},
		{"map past the reservation's end", v.mapAt(at(7), 2*g, h2), "not inside a reservation"},
		{"map over a mapping", v.mapAt(at(3), g, hFree), "overlaps"},
		{"map over a mapping's start", v.mapAt(at(1), 2*g, h2), "overlaps"},
		{"map an unknown handle", v.mapAt(at(0), g, 12345), "unknown handle"},
		{"map a released handle", v.mapAt(at(0), g, hGone), "handle"},
		{"access an unmapped range", v.setAccess(at(0), g), "not mapped"},
		{"access past the mappings", v.setAccess(at(2), 4*g), "not mapped"},
		{"access with a hole", v.setAccess(at(1), 4*g), "not mapped"},
		{"access part of a mapping", v.setAccess(at(2), g), "straddles"},
		{"access the end of a mapping", v.setAccess(at(3), 2*g), "straddles"},
		{"access outside a reservation", v.setAccess(at(8)+DevicePtr(1<<40), g), "not inside a reservation"},
		{"access across two reservations", v.setAccess(at(7), 2*g), "setAccess"},
		{"access unaligned", v.setAccess(at(2)+8, 2*g), "setAccess"},
		{"unmap half a mapping", v.unmap(at(2), g), "straddles"},
		{"unmap the second half", v.unmap(at(3), g), "straddles"},
		{"unmap across a mapping's end", v.unmap(at(3), 2*g), "straddles"},
		{"unmap outside a reservation", v.unmap(at(8)+DevicePtr(1<<40), g), "not inside a reservation"},
		{"unmap past the reservation's end", v.unmap(at(6), 3*g), "not inside a reservation"},
		{"unmap 0 bytes", v.unmap(at(2), 0), "unmap"},
		{"free a sub-range", v.free(at(0), 2*g), "not a whole reservation"},
		{"free the wrong size", v.free(base, 4*g), "not a whole reservation"},
		{"free inside", v.free(at(1), 7*g), "not a whole reservation"},
		{"free with mappings left", v.free(base, 8*g), "mappings are left"},
		{"free unaligned", v.free(base+1, 8*g), "free"},
		{"release unknown", v.release(999), "release"},
		{"release twice", v.release(hGone), "release"},
	} {
		require.ErrorIs(t, c.err, ErrInvalidArgument, c.name)
		require.Contains(t, c.err.Error(), "hostVMM.", c.name)
		require.Contains(t, c.err.Error(), c.want, c.name)
		require.Equal(t, before, v.stats(), c.name)
	}
	// The addresses appear in the message.
	require.Contains(t, v.unmap(at(2), g).Error(), hex(at(2)))
	// One handle at two addresses cannot be shown by host memory.
	require.ErrorIs(t, v.mapAt(at(0), g, hMappedElsewhere), ErrNotSupported)
	require.ErrorIs(t, v.mapAt(at(0), g, h1), ErrNotSupported)
	require.Equal(t, before, v.stats())

	// What the device accepts: unmapping an unmapped range (a no-op), and several whole mappings
	// in one call.
	require.NoError(t, v.unmap(at(0), 2*g))
	require.NoError(t, v.unmap(at(5), 3*g))
	require.Equal(t, before, v.stats())
	require.NoError(t, v.setAccess(at(2), 3*g))
	require.NoError(t, v.unmap(at(1), 5*g))
	require.False(t, v.mapped(at(2)))
	require.False(t, v.mapped(at(4)))
	require.Equal(t, 1, v.stats().Mappings, "the one in the other reservation")
	require.NoError(t, v.free(base, 8*g))
	require.ErrorIs(t, v.free(base, 8*g), ErrInvalidArgument, "a second free")
}

func ignoreHandle[T any](_ T, err error) error { return err }

func TestVMMHostPhysicalLimit(t *testing.T) {
	page := syscall.Getpagesize()
	v, g := vmmTestHost(t, 4*page)
	a, err := v.create(3 * g)
	require.NoError(t, err)
	_, err = v.create(2 * g)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Contains(t, err.Error(), "hostVMM.create")
	require.Equal(t, 3*g, v.stats().Physical)
	require.Equal(t, 1, v.stats().Creates)
	b, err := v.create(g)
	require.NoError(t, err)
	_, err = v.create(g)
	require.ErrorIs(t, err, ErrOutOfMemory)
	require.Equal(t, 4*g, v.stats().Physical)

	// Released but still mapped: still charged.
	base, err := v.reserve(4 * g)
	require.NoError(t, err)
	require.NoError(t, v.mapAt(base, 3*g, a))
	require.NoError(t, v.release(a))
	require.Equal(t, 4*g, v.stats().Physical)
	require.Equal(t, 2, v.stats().Handles)
	_, err = v.create(g)
	require.ErrorIs(t, err, ErrOutOfMemory)
	// Unmapped: given back.
	require.NoError(t, v.unmap(base, 3*g))
	require.Equal(t, g, v.stats().Physical)
	require.Equal(t, 1, v.stats().Handles)
	c, err := v.create(3 * g)
	require.NoError(t, err)
	require.NoError(t, v.release(b))
	require.NoError(t, v.release(c))
	require.NoError(t, v.free(base, 4*g))
	require.Equal(t, vmmStats{Creates: 3, Releases: 3, Maps: 1, Unmaps: 1}, v.stats())
}

// Release and unmap in either order give the memory back exactly once; a released handle can no
// longer be mapped or released.
func TestVMMHostReleaseAccounting(t *testing.T) {
	v, g := vmmTestHost(t, 0)
	base, err := v.reserve(8 * g)
	require.NoError(t, err)
	var hs []vmmHandle
	for i := 0; i < 4; i++ {
		h, err := v.create(g)
		require.NoError(t, err)
		require.NoError(t, v.mapAt(base+DevicePtr(i*g), g, h))
		hs = append(hs, h)
	}
	require.NoError(t, v.setAccess(base, 4*g))
	vmmTestFill(base, 4*g, 1)
	require.Equal(t, 4*g, v.stats().Physical)

	// Released while mapped: the memory stays usable and charged until the unmap.
	require.NoError(t, v.release(hs[1]))
	require.NoError(t, v.release(hs[2]))
	vmmTestCheck(t, base, 4*g, 1)
	require.Equal(t, 4*g, v.stats().Physical)
	require.ErrorIs(t, v.release(hs[1]), ErrInvalidArgument)
	require.ErrorIs(t, v.mapAt(base+DevicePtr(5*g), g, hs[1]), ErrInvalidArgument)

	// Unmapping granules 1..3 in one call gives back the two released handles only.
	require.NoError(t, v.unmap(base+DevicePtr(g), 3*g))
	require.Equal(t, 2*g, v.stats().Physical)
	require.Equal(t, 2, v.stats().Handles)
	require.Equal(t, 1, v.stats().Mappings)
	require.Equal(t, 3, v.stats().Unmaps)
	// Gone for good.
	require.ErrorIs(t, v.mapAt(base+DevicePtr(g), g, hs[1]), ErrInvalidArgument)
	// Unmapped but not released: still charged; mapped again it works.
	require.NoError(t, v.mapAt(base+DevicePtr(6*g), g, hs[3]))
	require.NoError(t, v.setAccess(base+DevicePtr(6*g), g))
	vmmTestFill(base+DevicePtr(6*g), g, 5)
	vmmTestCheck(t, base, g, 1)
	require.NoError(t, v.release(hs[3]))
	require.Equal(t, 2*g, v.stats().Physical)
	require.NoError(t, v.unmap(base, 8*g))
	require.Equal(t, g, v.stats().Physical)
	require.NoError(t, v.release(hs[0]))
	require.NoError(t, v.free(base, 8*g))
	require.Equal(t, vmmStats{Creates: 4, Releases: 4, Maps: 5, Unmaps: 5}, v.stats())
}

// Goroutines each grow and shrink their own reservation at once.
func TestVMMHostConcurrent(t *testing.T) {
	v, g := vmmTestHost(t, 0)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			errs <- func() error {
				base, err := v.reserve(8 * g)
				if err != nil {
					return err
				}
				for round := 0; round < 20; round++ {
					var hs []vmmHandle
					for i := 0; i < 4; i++ {
						h, err := v.create(2 * g)
						if err != nil {
							return err
						}
						if err := v.mapAt(base+DevicePtr(2*i*g), 2*g, h); err != nil {
							return err
						}
						hs = append(hs, h)
					}
					if err := v.setAccess(base, 8*g); err != nil {
						return err
					}
					b := hostBytes(base, 8*g)
					for i := range b {
						b[i] = byte(w + round)
					}
					for i := range b {
						if b[i] != byte(w+round) {
							return fmt.Errorf("worker %d: byte %d is %d", w, i, b[i])
						}
					}
					if err := v.unmap(base, 8*g); err != nil {
						return err
					}
					for _, h := range hs {
						if err := v.release(h); err != nil {
							return err
						}
					}
				}
				return v.free(base, 8*g)
			}()
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, vmmStats{Creates: 640, Releases: 640, Maps: 640, Unmaps: 640}, v.stats())
}

// Random operations on one reservation against a model that tracks each granule: every call
// succeeds exactly when the model says the device would accept it, and the mappings, access,
// charged bytes and memory contents then match. RMM_PROPERTY_SEED replays a run.
func TestVMMHostModel(t *testing.T) {
	const n = 24 // granules
	limit := 20 * syscall.Getpagesize()
	v, g := vmmTestHost(t, limit)
	seed := propertySeed(t)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	base, err := v.reserve(n * g)
	require.NoError(t, err)

	type mhandle struct {
		size             int // granules
		released, mapped bool
	}
	type mmap struct {
		start, size int
		h           vmmHandle
		access      bool
	}
	handles := map[vmmHandle]*mhandle{}
	var known []vmmHandle     // every handle ever created, and one never created
	owner := make([]*mmap, n) // mapping of each granule
	tag := make([]byte, n)    // the byte at the start of each accessible granule
	physical := 0
	addr := func(k int) DevicePtr { return base + DevicePtr(k*g) }
	// straddles reports whether a mapping crosses the boundary before granule k.
	straddles := func(k int) bool { return k > 0 && k < n && owner[k] != nil && owner[k] == owner[k-1] }
	succeeded, failed := map[string]int{}, map[string]int{}
	defer func() { t.Logf("succeeded %v, failed %v", succeeded, failed) }()

	for step := 0; step < 3000; step++ {
		start := rng.Intn(n)
		size := 1 + rng.Intn(4)
		kind := rng.Intn(5)
		if (kind == 2 || kind == 3) && rng.Intn(4) > 0 {
			// Mostly whole mappings: from the start of one over it and maybe its neighbours.
			var starts []int
			for k, m := range owner {
				if m != nil && m.start == k {
					starts = append(starts, k)
				}
			}
			if len(starts) > 0 {
				start = starts[rng.Intn(len(starts))]
				end := start + owner[start].size
				for more := rng.Intn(3); more > 0 && end < n && owner[end] != nil; more-- {
					end += owner[end].size
				}
				size = end - start
			}
		}
		inRange := start+size <= n
		var err error
		var want bool
		var op string
		switch kind {
		case 0:
			op = fmt.Sprintf("create(%d)", size)
			want = physical+size*g <= limit
			var h vmmHandle
			h, err = v.create(size * g)
			if err == nil {
				handles[h] = &mhandle{size: size}
				known = append(known, h)
				physical += size * g
			} else {
				require.ErrorIs(t, err, ErrOutOfMemory)
			}
		case 1:
			h := vmmHandle(777777)
			if len(known) > 0 && rng.Intn(10) > 0 {
				h = known[rng.Intn(len(known))]
			}
			if rng.Intn(2) == 0 {
				// Mostly a handle that can be mapped.
				for _, k := range known {
					if mh := handles[k]; mh != nil && !mh.released && !mh.mapped {
						h = k
						break
					}
				}
			}
			mh := handles[h]
			if mh != nil && rng.Intn(4) > 0 {
				size = mh.size
				inRange = start+size <= n
			}
			op = fmt.Sprintf("mapAt(%d, %d, %d)", start, size, h)
			want = inRange && mh != nil && !mh.released && !mh.mapped && mh.size == size
			for k := start; want && k < start+size; k++ {
				want = owner[k] == nil
			}
			err = v.mapAt(addr(start), size*g, h)
			if err == nil {
				m := &mmap{start: start, size: size, h: h}
				for k := start; k < start+size; k++ {
					owner[k] = m
				}
				mh.mapped = true
			}
		case 2:
			op = fmt.Sprintf("setAccess(%d, %d)", start, size)
			want = inRange && !straddles(start) && !straddles(start+size)
			for k := start; want && k < start+size; k++ {
				want = owner[k] != nil
			}
			err = v.setAccess(addr(start), size*g)
			if err == nil {
				for k := start; k < start+size; k++ {
					owner[k].access = true
				}
			}
		case 3:
			op = fmt.Sprintf("unmap(%d, %d)", start, size)
			want = inRange && !straddles(start) && !straddles(start+size)
			err = v.unmap(addr(start), size*g)
			if err == nil {
				for k := start; k < start+size; k++ {
					if m := owner[k]; m != nil && m.start == k {
						mh := handles[m.h]
						mh.mapped = false
						if mh.released {
							delete(handles, m.h)
							physical -= mh.size * g
						}
					}
					owner[k] = nil
					tag[k] = 0
				}
			}
		case 4:
			h := vmmHandle(888888)
			if len(known) > 0 && rng.Intn(10) > 0 {
				h = known[rng.Intn(len(known))]
			}
			if rng.Intn(2) == 0 {
				// Mostly a live handle, mapped or not.
				var live []vmmHandle
				for _, k := range known {
					if mh := handles[k]; mh != nil && !mh.released {
						live = append(live, k)
					}
				}
				if len(live) > 0 {
					h = live[rng.Intn(len(live))]
				}
			}
			op = fmt.Sprintf("release(%d)", h)
			mh := handles[h]
			want = mh != nil && !mh.released
			err = v.release(h)
			if err == nil {
				mh.released = true
				if !mh.mapped {
					delete(handles, h)
					physical -= mh.size * g
				}
			}
		}
		name := op[:strings.IndexByte(op, '(')]
		if err == nil {
			succeeded[name]++
		} else {
			failed[name]++
		}
		if want {
			require.NoError(t, err, "step %d: %s (seed %d)", step, op, seed)
		} else {
			require.Error(t, err, "step %d: %s (seed %d)", step, op, seed)
		}

		st := v.stats()
		require.Equal(t, physical, st.Physical, "step %d: %s (seed %d)", step, op, seed)
		require.Equal(t, len(handles), st.Handles, "step %d: %s (seed %d)", step, op, seed)
		maps := 0
		for k := 0; k < n; k++ {
			m := owner[k]
			if m != nil && m.start == k {
				maps++
			}
			require.Equal(t, m != nil, v.mapped(addr(k)), "step %d: %s: granule %d (seed %d)", step, op, k, seed)
			acc := m != nil && m.access
			require.Equal(t, acc, v.accessible(addr(k)), "step %d: %s: granule %d (seed %d)", step, op, k, seed)
			if acc {
				p := (*byte)(addrToPointer(uintptr(addr(k))))
				require.Equal(t, tag[k], *p, "step %d: %s: contents of granule %d (seed %d)", step, op, k, seed)
				tag[k] = byte(rng.Intn(256))
				*p = tag[k]
			}
		}
		require.Equal(t, maps, st.Mappings, "step %d: %s (seed %d)", step, op, seed)
	}
}

func TestVMMDeviceWithoutCUDA(t *testing.T) {
	if CUDAAvailable() == nil {
		t.Skip("a CUDA device is present")
	}
	_, err := newDeviceVMM(0)
	require.ErrorIs(t, err, ErrNoDevice)
}

// deviceVMM on the GPU: two chunks mapped back to back in a 1 GiB reservation, filled and
// copied across the seam; free device memory drops at create and comes back at unmap+release.
func TestVMMDevice(t *testing.T) {
	requireGPU(t)
	v, err := newDeviceVMM(0)
	require.NoError(t, err)
	g := v.granularity() // 2 MiB on the H200
	require.Positive(t, g)
	require.Zero(t, g%4096)
	ctx, err := Device(0).ctx()
	require.NoError(t, err)

	const reserved = 1 << 30
	base, err := v.reserve(reserved)
	require.NoError(t, err)
	require.Zero(t, uintptr(base)%uintptr(g))

	free0, _, err := Device(0).MemoryInfo()
	require.NoError(t, err)
	h1, err := v.create(g)
	require.NoError(t, err)
	h2, err := v.create(g)
	require.NoError(t, err)
	free1, _, err := Device(0).MemoryInfo()
	require.NoError(t, err)
	require.GreaterOrEqual(t, free0-free1, 2*g, "memory is charged at create: free %d then %d", free0, free1)

	// Misuse the wrapper catches before the driver.
	require.ErrorIs(t, v.mapAt(base, 2*g, h1), ErrInvalidArgument)
	require.ErrorIs(t, v.mapAt(base, g, 0xdead), ErrInvalidArgument)
	require.ErrorIs(t, v.setAccess(base+1, g), ErrInvalidArgument)
	require.ErrorIs(t, v.release(0xdead), ErrInvalidArgument)
	_, err = v.create(g + 4096)
	require.ErrorIs(t, err, ErrInvalidArgument)

	require.NoError(t, v.mapAt(base, g, h1))
	require.NoError(t, v.mapAt(base+DevicePtr(g), g, h2))
	require.NoError(t, v.setAccess(base, 2*g))

	// Fill all of both chunks, then a span across the seam, and copy the seam span to the start.
	require.NoError(t, deviceFill(0, base, 2*g, []byte{1, 2, 3, 4}, DefaultStream))
	seam := base + DevicePtr(g) - 4096
	require.NoError(t, deviceFill(0, seam, 8192, []byte{0xa0, 0xb1, 0xc2, 0xd3, 0xe4, 0xf5, 0x06, 0x17}, DefaultStream))
	require.NoError(t, deviceCopy(0, base, seam, 8192, DefaultStream))
	host := make([]byte, 2*g)
	require.NoError(t, cuMemcpyDtoHSync(ctx, unsafe.Pointer(&host[0]), base, 2*g, DefaultStream.cu()))
	for i := 0; i < 2*g; i++ {
		var want byte
		switch {
		case i < 8192, i >= g-4096 && i < g+4096:
			want = []byte{0xa0, 0xb1, 0xc2, 0xd3, 0xe4, 0xf5, 0x06, 0x17}[i%8]
		default:
			want = byte(i%4 + 1)
		}
		if host[i] != want {
			t.Fatalf("byte %d is %#x, want %#x", i, host[i], want)
		}
	}
	require.NoError(t, DefaultStream.Synchronize())

	require.NoError(t, v.unmap(base, 2*g))
	require.NoError(t, v.release(h1))
	require.NoError(t, v.release(h2))
	require.ErrorIs(t, v.release(h1), ErrInvalidArgument)
	free2, _, err := Device(0).MemoryInfo()
	require.NoError(t, err)
	require.GreaterOrEqual(t, free2-free1, 2*g, "memory comes back at unmap+release: free %d then %d", free1, free2)
	require.NoError(t, v.free(base, reserved))
}

// Without CUDA, an expandable pool runs on hostVMM: its memory is usable across growth steps and
// Release gives every chunk back.
func TestVMMHostBacksExpandablePool(t *testing.T) {
	if CUDAAvailable() == nil {
		t.Skip("with CUDA the expandable pool runs on deviceVMM")
	}
	if _, err := newHostVMM(hostVMMGranularity, 0); err != nil {
		t.Skipf("hostVMM: %v", err)
	}
	p, err := NewPoolMemoryResource(NewSystemMemoryResource(), &PoolOptions{Expandable: true, MaximumPoolSize: 1 << 30})
	require.NoError(t, err)
	const n = 40 << 20
	var ps []DevicePtr
	for i := 0; i < 3; i++ {
		q, err := p.Allocate(n, DefaultStream)
		require.NoError(t, err)
		vmmTestFill(q, n, byte(i))
		ps = append(ps, q)
	}
	for i, q := range ps {
		vmmTestCheck(t, q, n, byte(i))
		require.NoError(t, p.Deallocate(q, n, DefaultStream))
	}
	require.NoError(t, p.Release())
	require.Zero(t, p.PoolSize())
}
