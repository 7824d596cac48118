package rmmtest

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gormm/rmm"
)

// The fixed checks: librmm's checklist for every memory resource.

// tryAllocate allocates n bytes on stream through the model. It returns an error when the
// resource broke its contract or failed where it may not; a nil block and a nil error mean an
// out-of-memory error the options allow (see config.mayRunOut).
func (in *instance) tryAllocate(n, stream int) (*block, error) {
	live := int(in.reserved.Load())
	b, err, bad := in.allocate(n, stream)
	if in.concurrent {
		live = max(live, int(in.peak.Load()))
	}
	switch {
	case bad != nil:
		return nil, bad
	case err == nil:
		return b, nil
	case errors.Is(err, rmm.ErrOutOfMemory) && in.cfg.mayRunOut(live, n):
		return nil, nil
	}
	return nil, fmt.Errorf("Allocate(%d, %s) with %d bytes live: %w", n, streamName(stream), live, err)
}

// need is tryAllocate that ends t on an error.
func (in *instance) need(t tester, n, stream int) *block {
	t.Helper()
	b, err := in.tryAllocate(n, stream)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return b
}

// mustFree frees b on stream and ends t on an error.
func (in *instance) mustFree(t tester, b *block, stream int) {
	t.Helper()
	if b == nil {
		return
	}
	if err := in.free(b, stream); err != nil {
		t.Fatalf("%v", err)
	}
}

// mustVerify ends t when the resource does not match the model.
func (in *instance) mustVerify(t tester, when string) {
	t.Helper()
	if err := in.verify(); err != nil {
		t.Fatalf("%s: %v", when, err)
	}
}

// streamIndexes returns DefaultStream's index and, when there is one, a Stream's.
func (in *instance) streamIndexes() []int {
	if len(in.views) > 1 {
		return []int{0, 1}
	}
	return []int{0}
}

// rng returns the random source of the check t, derived from the seed and t's name.
func (s *suite) rng(t tester) *rand.Rand {
	h := fnv.New64a()
	h.Write([]byte(t.Name()))
	return rand.New(rand.NewPCG(uint64(s.cfg.seed), h.Sum64()))
}

// hintOnFailure logs how to replay t when it failed; for deferring.
func (s *suite) hintOnFailure(t tester) {
	if t.Failed() {
		t.Logf("seed %d: %s", s.cfg.seed, replayHint(t, s.cfg.seed))
	}
}

// Item 1: non-zero allocations are non-null and 256-aligned, and the memory is accessible.
func (s *suite) testAlignment(t tester) {
	in := s.newInstance(t, min(1, s.cfg.streams))
	if in.access == 0 && !in.addressOnly() {
		t.Errorf("rmm.AccessOf(%T) is 0 (its memory can be touched neither by the host nor by a device) over an upstream whose memory is %v", in.mr, in.upAccess)
	}
	if silent := silentAbout(in.mr); silent != nil && in.upAccess&rmm.HostAccessible != 0 {
		if err := rmm.CUDAAvailable(); err != nil {
			t.Logf("rmmtest: %T implements neither Access (rmm.Accessible) nor Upstream (rmm.Upstreamer), so rmm.AccessOf takes its memory as device memory and the checks of host memory are not made (without CUDA: %v); implement Upstream or Access to have them made", silent, err)
		}
	}
	for _, stream := range in.streamIndexes() {
		for _, n := range []int{1, 8, 255, 256, 257, 4*kiB + 1, 64 * kiB, miB + 1} {
			if n > s.cfg.maxSize {
				continue
			}
			b := in.need(t, n, stream)
			in.mustVerify(t, fmt.Sprintf("after Allocate(%d, %s)", n, streamName(stream)))
			in.mustFree(t, b, stream)
		}
	}
	in.mustVerify(t, "everything freed")
}

// Item 2: two live 8-byte allocations have different pointers.
func (s *suite) testDistinct(t tester) {
	in := s.newInstance(t, min(1, s.cfg.streams))
	for _, stream := range in.streamIndexes() {
		a := in.need(t, min(8, s.cfg.maxSize), stream)
		b, err := in.tryAllocate(min(8, s.cfg.maxSize), stream)
		if err != nil {
			t.Fatalf("second allocation: %v", err)
		}
		if a != nil && b != nil && a.ptr == b.ptr {
			t.Fatalf("two live 8-byte allocations on %s share the pointer %#x", streamName(stream), uintptr(a.ptr))
		}
		in.mustVerify(t, "two live 8-byte allocations")
		in.mustFree(t, a, stream)
		in.mustFree(t, b, stream)
	}
}

// silentAbout returns the resource where rmm.AccessOf's walk from mr stops without an answer
// (one that implements neither rmm.Accessible nor rmm.Upstreamer), nil when one answers.
func silentAbout(mr rmm.MemoryResource) rmm.MemoryResource {
	for mr != nil {
		if _, ok := mr.(rmm.Accessible); ok {
			return nil
		}
		u, ok := mr.(rmm.Upstreamer)
		if !ok {
			return mr
		}
		mr = u.Upstream()
	}
	return nil
}

// Item 3: Allocate(0) and Deallocate(0, 0) succeed and change nothing but counts of calls (see
// unchangedByZero). Each zero-byte allocation is freed once, as any other.
func (s *suite) testZeroSize(t tester) {
	in := s.newInstance(t, min(1, s.cfg.streams))
	keep := in.need(t, min(300, s.cfg.maxSize), 0) // something live, so that "unchanged" means something
	for _, stream := range in.streamIndexes() {
		sv := in.views[stream]
		before := in.observe()
		p, err := in.mr.Allocate(0, sv)
		if err != nil || p != 0 {
			t.Errorf("Allocate(0, %s) = (%#x, %v), want (0, nil)", streamName(stream), uintptr(p), err)
		}
		if err := in.mr.Deallocate(p, 0, sv); err != nil {
			t.Errorf("Deallocate(%#x, 0, %s) = %v, want nil", uintptr(p), streamName(stream), err)
		}
		if err := unchangedByZero(before, in.observe()); err != nil {
			t.Errorf("zero-byte Allocate and Deallocate on %s: %v", streamName(stream), err)
		}
	}
	in.mustVerify(t, "after zero-byte calls")
	in.mustFree(t, keep, 0)
}

// A negative size wraps ErrInvalidArgument and changes nothing.
func (s *suite) testNegativeSize(t tester) {
	in := s.newInstance(t, min(1, s.cfg.streams))
	keep := in.need(t, min(300, s.cfg.maxSize), 0)
	for _, stream := range in.streamIndexes() {
		before := in.observe()
		p, err := in.mr.Allocate(-1, in.views[stream])
		if !errors.Is(err, rmm.ErrInvalidArgument) || p != 0 {
			t.Errorf("Allocate(-1, %s) = (%#x, %v), want an error wrapping rmm.ErrInvalidArgument", streamName(stream), uintptr(p), err)
			if err == nil && p != 0 {
				continue // leave the bogus block where it is
			}
		}
		if err := unchanged(before, in.observe()); err != nil {
			t.Errorf("Allocate(-1, %s): %v", streamName(stream), err)
		}
	}
	in.mustVerify(t, "after Allocate(-1)")
	in.mustFree(t, keep, 0)
}

// Item 4: fixed sizes succeed or fail with ErrOutOfMemory only.
func (s *suite) testSizes(t tester) {
	in := s.newInstance(t, 0)
	for _, n := range []int{4, kiB, miB, giB} {
		if n > s.cfg.maxAllocationSize {
			t.Logf("%s skipped: above Options.MaxAllocationSize (%d bytes)", rmm.FormatBytes(int64(n)), s.cfg.maxAllocationSize)
			continue
		}
		before := in.observe()
		b, err, bad := in.allocate(n, 0)
		switch {
		case bad != nil:
			t.Fatalf("%v", bad)
		case err != nil && !errors.Is(err, rmm.ErrOutOfMemory):
			t.Errorf("Allocate(%d) = %v, want success or an error wrapping rmm.ErrOutOfMemory", n, err)
		case err != nil:
			if uerr := unchangedAccounting(before, in.observe()); uerr != nil {
				t.Errorf("Allocate(%d) failed (%v), and: %v", n, err, uerr)
			}
		default:
			in.mustVerify(t, fmt.Sprintf("after Allocate(%d)", n))
			in.mustFree(t, b, 0)
		}
	}
	in.mustVerify(t, "everything freed")
}

// Item 4: 1 PiB fails with ErrOutOfMemory, names the size, changes nothing, and the resource
// keeps working.
func (s *suite) testOutOfMemory(t tester) {
	if s.cfg.capacity >= piB || s.cfg.maxAllocationSize >= piB {
		t.Skipf("the options say the resource can hold 1 PiB")
	}
	in := s.newInstance(t, min(1, s.cfg.streams))
	keep := in.need(t, min(4*kiB, s.cfg.maxSize), 0)
	for _, stream := range in.streamIndexes() {
		sv := in.views[stream]
		before := in.observe()
		p, err := in.mr.Allocate(piB, sv)
		call := fmt.Sprintf("Allocate(1 PiB, %s)", streamName(stream))
		switch {
		case err == nil:
			t.Errorf("%s succeeded (%#x), want an error wrapping rmm.ErrOutOfMemory", call, uintptr(p))
			if derr := in.mr.Deallocate(p, piB, sv); derr != nil {
				t.Errorf("freeing it: %v", derr)
			}
			continue
		case !errors.Is(err, rmm.ErrOutOfMemory):
			t.Errorf("%s = %v, want an error wrapping rmm.ErrOutOfMemory", call, err)
		case !strings.Contains(err.Error(), strconv.Itoa(piB)):
			t.Errorf("%s: the message %q does not name the size (%d)", call, err, piB)
		}
		if p != 0 {
			t.Errorf("%s failed but returned the pointer %#x, not 0", call, uintptr(p))
		}
		if err := unchangedAccounting(before, in.observe()); err != nil {
			t.Errorf("%s: %v", call, err)
		}
		// The resource keeps working.
		b := in.need(t, min(256, s.cfg.maxSize), stream)
		in.mustVerify(t, "an allocation after running out of memory")
		in.mustFree(t, b, stream)
	}
	in.mustFree(t, keep, 0)
	in.mustVerify(t, "everything freed")
}

// randomSize draws a size in [1, hi].
func randomSize(r *rand.Rand, hi int) int { return 1 + r.IntN(max(1, hi)) }

// Item 5: 100 random sizes in [1, 5 MiB] allocated, then all freed; on DefaultStream and a Stream.
func (s *suite) testRandomSizes(t tester) {
	s.perStream(t, func(t tester, in *instance, stream int) {
		r := s.rng(t)
		hi := min(5*miB, s.cfg.maxSize)
		var bs []*block
		for range 100 * s.cfg.scale {
			if b := in.need(t, randomSize(r, hi), stream); b != nil {
				bs = append(bs, b)
			}
		}
		in.mustVerify(t, fmt.Sprintf("%d allocations live", len(bs)))
		for _, b := range bs {
			in.mustFree(t, b, stream)
		}
		in.mustVerify(t, "everything freed")
	})
}

// Item 5: 200 random steps, 53% allocations (at most 100 live), then everything freed.
func (s *suite) testMixed(t tester) {
	s.perStream(t, func(t tester, in *instance, stream int) {
		if err := mixedAllocFree(in, s.rng(t), stream, 200*s.cfg.scale, 10, false); err != nil {
			t.Fatalf("%v", err)
		}
		in.mustVerify(t, "everything freed")
	})
}

// mixedAllocFree runs steps random allocations and frees on stream (53% allocations while fewer
// than 100 are live, sizes up to 5 MiB), verifying the whole resource every verifyEvery steps
// (0: never), then frees what is left. With crossFrees, one free in five is on another stream.
func mixedAllocFree(in *instance, r *rand.Rand, stream, steps, verifyEvery int, crossFrees bool) error {
	hi := min(5*miB, in.cfg.maxSize)
	var bs []*block
	freeOn := func() int {
		if crossFrees && len(in.views) > 1 && r.IntN(5) == 0 {
			return (stream + 1 + r.IntN(len(in.views)-1)) % len(in.views)
		}
		return stream
	}
	for i := range steps {
		if len(bs) == 0 || (len(bs) < 100 && r.IntN(100) < 53) {
			b, err := in.tryAllocate(randomSize(r, hi), stream)
			if err != nil {
				return fmt.Errorf("step %d: %w", i, err)
			}
			if b != nil {
				bs = append(bs, b)
			}
		} else {
			k := r.IntN(len(bs))
			b := bs[k]
			bs[k] = bs[len(bs)-1]
			bs = bs[:len(bs)-1]
			if err := in.free(b, freeOn()); err != nil {
				return fmt.Errorf("step %d: %w", i, err)
			}
		}
		if verifyEvery > 0 && i%verifyEvery == 0 {
			if err := in.verify(); err != nil {
				return fmt.Errorf("after step %d: %w", i, err)
			}
		}
	}
	for _, b := range bs {
		if err := in.free(b, stream); err != nil {
			return fmt.Errorf("freeing the rest: %w", err)
		}
	}
	return nil
}

// perStream runs f as the sub-tests DefaultStream and Stream (when the options allow streams),
// each over a fresh resource.
func (s *suite) perStream(t tester, f func(t tester, in *instance, stream int)) {
	t.Run("DefaultStream", func(t tester) {
		defer s.hintOnFailure(t)
		f(t, s.newInstance(t, 0), 0)
	})
	if s.cfg.streams > 0 {
		t.Run("Stream", func(t tester) {
			defer s.hintOnFailure(t)
			f(t, s.newInstance(t, 1), 1)
		})
	}
}

// Item 6: the random and fixed-size checks on four goroutines (Options.Goroutines) at once, and
// allocations freed on another goroutine (on the same stream and on another). With
// Options.ConcurrentInvariants one more goroutine checks the resource while they run.
func (s *suite) testConcurrent(t tester) {
	goroutines := s.cfg.goroutines
	hi := min(5*miB, s.cfg.maxSize)
	t.Run("RandomSizes", func(t tester) {
		defer s.hintOnFailure(t)
		in := s.newInstance(t, s.cfg.streams)
		in.concurrent = true
		defer in.watch(t)()
		s.parallel(t, goroutines, func(g int, r *rand.Rand) error {
			stream := g % len(in.views)
			var bs []*block
			for range 100 * s.cfg.scale {
				b, err := in.tryAllocate(randomSize(r, hi), stream)
				if err != nil {
					return err
				}
				if b != nil {
					bs = append(bs, b)
				}
			}
			for _, b := range bs {
				if err := in.free(b, stream); err != nil {
					return err
				}
			}
			return nil
		})
		in.mustVerify(t, "everything freed")
	})
	t.Run("Sizes", func(t tester) {
		in := s.newInstance(t, s.cfg.streams)
		in.concurrent = true
		defer in.watch(t)()
		s.parallel(t, goroutines, func(g int, r *rand.Rand) error {
			stream := g % len(in.views)
			for range 10 * s.cfg.scale {
				for _, n := range []int{4, kiB, miB} {
					if n > s.cfg.maxSize {
						continue
					}
					b, err, bad := in.allocate(n, stream)
					switch {
					case bad != nil:
						return bad
					case err != nil && !errors.Is(err, rmm.ErrOutOfMemory):
						return fmt.Errorf("Allocate(%d, %s) = %v, want success or an error wrapping rmm.ErrOutOfMemory", n, streamName(stream), err)
					case err == nil:
						if err := in.free(b, stream); err != nil {
							return err
						}
					}
				}
			}
			return nil
		})
		in.mustVerify(t, "everything freed")
	})
	t.Run("MixedAllocFree", func(t tester) {
		defer s.hintOnFailure(t)
		in := s.newInstance(t, s.cfg.streams)
		in.concurrent = true
		defer in.watch(t)()
		s.parallel(t, goroutines, func(g int, r *rand.Rand) error {
			return mixedAllocFree(in, r, g%len(in.views), 200*s.cfg.scale, 0, true)
		})
		in.mustVerify(t, "everything freed")
	})
	across := func(t tester, other bool) {
		defer s.hintOnFailure(t)
		in := s.newInstance(t, s.cfg.streams)
		in.concurrent = true
		defer in.watch(t)()
		hi := min(miB, s.cfg.maxSize)
		// Even goroutines allocate, odd ones free what their partner allocated (a last odd
		// goroutine out has no partner and does nothing).
		chans := make([]chan *block, goroutines/2)
		for i := range chans {
			chans[i] = make(chan *block, 8)
		}
		s.parallel(t, goroutines, func(g int, r *rand.Rand) error {
			pair := g / 2
			if pair == len(chans) {
				return nil
			}
			stream := pair % len(in.views)
			ch := chans[pair]
			if g%2 == 0 {
				defer close(ch)
				for range 100 * s.cfg.scale {
					b, err := in.tryAllocate(randomSize(r, hi), stream)
					if err != nil {
						return err
					}
					if b != nil {
						ch <- b
					}
				}
				return nil
			}
			if other {
				stream = (stream + 1) % len(in.views)
			}
			var first error
			for b := range ch { // drain, so that the producer never blocks
				if first == nil {
					first = in.free(b, stream)
				}
			}
			return first
		})
		in.mustVerify(t, "everything freed")
	}
	t.Run("AcrossGoroutines/SameStream", func(t tester) { across(t, false) })
	if s.cfg.streams > 0 {
		t.Run("AcrossGoroutines/OtherStream", func(t tester) { across(t, true) })
	}
}

// watch, with Options.ConcurrentInvariants, checks the resource from a goroutine of its own
// (checkNow) until the function it returns is called, which then fails t with the first failure
// seen. For deferring before goroutines start.
func (in *instance) watch(t tester) func() {
	if !in.cfg.concurrentInvariants || (in.invariants == nil && in.stats == nil) {
		return func() {}
	}
	done := make(chan struct{})
	result := make(chan error, 1)
	go func() {
		for {
			if err := in.checkNow(); err != nil {
				result <- err
				return
			}
			select {
			case <-done:
				result <- nil
				return
			default:
			}
			time.Sleep(100 * time.Microsecond) // leave the resource to the goroutines most of the time
		}
	}()
	return func() {
		close(done)
		if err := <-result; err != nil {
			t.Errorf("while the goroutines ran: %v", err)
		}
	}
}

// checkNow checks what holds at any instant, even while goroutines allocate and free:
// CheckInvariants, and a PoolStats against itself.
func (in *instance) checkNow() error {
	if in.invariants != nil {
		if err := in.invariants(); err != nil {
			return fmt.Errorf("CheckInvariants: %w", err)
		}
	}
	if in.stats == nil {
		return nil
	}
	st, ok := in.stats().(rmm.PoolStats)
	switch {
	case !ok:
	case st.FreeBytes != st.PoolSize-st.LiveBytes:
		return fmt.Errorf("rmmtest: Stats: FreeBytes %d != PoolSize %d - LiveBytes %d", st.FreeBytes, st.PoolSize, st.LiveBytes)
	case st.LargestFreeBlock > st.FreeBytes || st.LargestFreeBlock < 0:
		return fmt.Errorf("rmmtest: Stats: LargestFreeBlock %d outside [0, FreeBytes %d]", st.LargestFreeBlock, st.FreeBytes)
	case st.MaximumPoolSize > 0 && st.PoolSize > st.MaximumPoolSize:
		return fmt.Errorf("rmmtest: Stats: PoolSize %d exceeds MaximumPoolSize %d", st.PoolSize, st.MaximumPoolSize)
	}
	return nil
}

// parallel runs f on n goroutines, each with its own random source, and fails t with their
// errors.
func (s *suite) parallel(t tester, n int, f func(g int, r *rand.Rand) error) {
	t.Helper()
	base := s.rng(t)
	rs := make([]*rand.Rand, n)
	for g := range rs {
		rs[g] = rand.New(rand.NewPCG(base.Uint64(), uint64(g)))
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for g := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				if p := recover(); p != nil {
					errs[g] = fmt.Errorf("panic: %v", p)
				}
			}()
			errs[g] = f(g, rs[g])
		}()
	}
	wg.Wait()
	for g, err := range errs {
		if err != nil {
			t.Errorf("goroutine %d: %v", g, err)
		}
	}
	if t.Failed() {
		t.Fatalf("stopped after the goroutines' errors")
	}
}

// sameResource reports whether a and b are the same resource (== on comparable dynamic types).
func sameResource(a, b rmm.MemoryResource) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	ta, tb := reflect.TypeOf(a), reflect.TypeOf(b)
	return ta == tb && ta.Comparable() && a == b
}

// currentMu is held by a suite while it changes the process-wide current device resource
// (testCurrentDeviceResource), and read-held by the default upstream (currentResource), so that
// suites running in parallel tests neither take turns at it together nor build over another
// suite's resource.
var currentMu sync.RWMutex

// currentResource is the default Options.Upstream: rmm.CurrentDeviceResource, read while no suite
// changes it.
func currentResource() rmm.MemoryResource {
	currentMu.RLock()
	defer currentMu.RUnlock()
	return rmm.CurrentDeviceResource()
}

// Item 7: setting and getting the current device resource from many goroutines is consistent.
func (s *suite) testCurrentDeviceResource(t tester) {
	in := s.newInstance(t, 0)
	currentMu.Lock()
	defer currentMu.Unlock()
	in.concurrent = true
	if !reflect.TypeOf(in.mr).Comparable() {
		t.Skipf("%T is not comparable (see Equality)", in.mr)
	}
	const goroutines = 8
	prev := rmm.SetCurrentDeviceResource(in.mr)
	restored := false
	defer func() {
		if !restored {
			rmm.SetCurrentDeviceResource(prev)
		}
	}()
	// Everyone sets the resource and gets it back, and allocates through it.
	s.parallel(t, goroutines, func(g int, r *rand.Rand) error {
		for i := range 50 * s.cfg.scale {
			rmm.SetCurrentDeviceResource(in.mr)
			got := rmm.CurrentDeviceResource()
			if !sameResource(got, in.mr) {
				return fmt.Errorf("step %d: CurrentDeviceResource() = %T %p after every goroutine set %T %p", i, got, got, in.mr, in.mr)
			}
			if i%10 == 0 {
				b, err := in.tryAllocate(randomSize(r, min(4*kiB, s.cfg.maxSize)), 0)
				if err != nil {
					return err
				}
				if b != nil {
					if err := in.free(b, 0); err != nil {
						return err
					}
				}
			}
		}
		return nil
	})
	// Half the goroutines switch between the resource and the previous one: everyone sees one
	// of the two, and Set returns one of the two.
	s.parallel(t, goroutines, func(g int, r *rand.Rand) error {
		for i := range 50 * s.cfg.scale {
			if g%2 == 0 {
				next := in.mr
				if r.IntN(2) == 0 {
					next = prev
				}
				if old := rmm.SetCurrentDeviceResource(next); !sameResource(old, in.mr) && !sameResource(old, prev) {
					return fmt.Errorf("step %d: SetCurrentDeviceResource returned %T %p, neither the resource nor the previous one", i, old, old)
				}
			}
			if got := rmm.CurrentDeviceResource(); !sameResource(got, in.mr) && !sameResource(got, prev) {
				return fmt.Errorf("step %d: CurrentDeviceResource() = %T %p, neither the resource nor the previous one", i, got, got)
			}
		}
		return nil
	})
	rmm.SetCurrentDeviceResource(in.mr)
	if got := rmm.CurrentDeviceResource(); !sameResource(got, in.mr) {
		t.Errorf("CurrentDeviceResource() = %T %p right after setting %T %p", got, got, in.mr, in.mr)
	}
	if old := rmm.SetCurrentDeviceResource(prev); !sameResource(old, in.mr) {
		t.Errorf("SetCurrentDeviceResource(previous) returned %T %p, want the resource %T %p", old, old, in.mr, in.mr)
	}
	restored = true
	if got := rmm.CurrentDeviceResource(); !sameResource(got, prev) {
		t.Errorf("CurrentDeviceResource() = %T %p after restoring %T %p", got, got, prev, prev)
	}
	in.mustVerify(t, "everything freed")
}

// Item 8: the resource equals itself; two resources that compare equal are interchangeable.
func (s *suite) testEquality(t tester) {
	in := s.newInstance(t, 0)
	typ := reflect.TypeOf(in.mr)
	if !typ.Comparable() {
		t.Fatalf("%v is not comparable, so == on an rmm.MemoryResource holding it panics (use a pointer type)", typ)
	}
	var a, b rmm.MemoryResource = in.mr, in.mr
	if a != b {
		t.Errorf("the resource (%T) does not equal itself", in.mr)
	}
	other := s.newInstance(t, 0)
	if sameResource(in.mr, other.mr) {
		// Equal resources must be interchangeable: memory from one is freed by the other.
		x := in.need(t, min(1000, s.cfg.maxSize), 0)
		if x != nil {
			in.forget(x)
			if err := other.mr.Deallocate(x.ptr, x.size, rmm.DefaultStream); err != nil {
				t.Errorf("two resources compare equal, but memory from one cannot be freed by the other: %v", err)
			}
			in.reserved.Add(-int64(roundUp(x.size)))
		}
	}
}

// logUniform returns a size in [lo, hi] drawn uniformly in log scale.
func logUniform(r interface{ Float64() float64 }, lo, hi int) int {
	if hi <= lo {
		return lo
	}
	e := math.Log2(float64(lo)) + r.Float64()*(math.Log2(float64(hi)+1)-math.Log2(float64(lo)))
	return max(lo, min(hi, int(math.Exp2(e))))
}
