package rmmtest

import (
	"errors"
	"fmt"

	"github.com/gormm/rmm"
)

// The ClosedStream check: a resource never hands the driver the handle of a stream that was
// destroyed. A Stream's Close destroys its handle, which the driver may give to the next stream
// created; a resource that kept using it would crash the process or order its work on a stranger.

// testClosedStream runs the four cases, each over a fresh resource.
func (s *suite) testClosedStream(t tester) {
	c := s.cfg
	if c.streams == 0 {
		t.Skipf("Options.Streams is negative: DefaultStream only")
	}
	small, large := min(1000, c.maxSize), min(miB+1, c.maxSize)

	// A free on a view of a Stream that was closed succeeds, whether the memory was allocated on
	// that Stream or on another one; memory allocated on it is also freed on a live Stream.
	t.Run("FreeOnClosed", func(t tester) {
		defer s.hintOnFailure(t)
		in := s.newInstance(t, 0)
		si := in.mustAddStream(t)
		a := in.need(t, small, si)
		b := in.need(t, large, si)
		e := in.need(t, small, si)
		d := in.need(t, small, 0)
		in.mustVerify(t, "four allocations, three on a Stream")
		if err := in.closeStream(si); err != nil {
			t.Fatalf("closing the Stream: %v", err)
		}
		in.mustVerify(t, "the Stream closed with two allocations on it live")
		for _, x := range []*block{a, b, d} {
			if x == nil {
				continue
			}
			if err := in.free(x, si); err != nil {
				t.Fatalf("freeing %v on the closed Stream: %v, want nil", x, err)
			}
			in.mustVerify(t, fmt.Sprintf("%v freed on the closed Stream", x))
		}
		other := in.mustAddStream(t)
		if e != nil {
			if err := in.free(e, other); err != nil {
				t.Fatalf("freeing %v, allocated on the closed Stream, on another Stream: %v, want nil", e, err)
			}
		}
		// The memory is usable again.
		x := in.need(t, large, 0)
		in.mustVerify(t, "an allocation on DefaultStream after frees on a closed Stream")
		in.mustFree(t, x, 0)
		in.mustVerify(t, "everything freed")
	})

	// Memory freed on a Stream that is then closed is handed out again, on DefaultStream and on
	// another Stream.
	t.Run("FreeThenReuse", func(t tester) {
		defer s.hintOnFailure(t)
		in := s.newInstance(t, 0)
		si := in.mustAddStream(t)
		sizes := []int{small, large, small}
		var bs []*block
		for _, n := range sizes {
			bs = append(bs, in.need(t, n, si))
		}
		for _, b := range bs {
			in.mustFree(t, b, si)
		}
		if err := in.closeStream(si); err != nil {
			t.Fatalf("closing the Stream: %v", err)
		}
		in.mustVerify(t, "the Stream closed with its frees")
		other := in.mustAddStream(t)
		for _, stream := range []int{0, other} {
			bs = bs[:0]
			for _, n := range sizes {
				bs = append(bs, in.need(t, n, stream))
			}
			in.mustVerify(t, fmt.Sprintf("allocations on %s after the Stream closed", streamName(stream)))
			for _, b := range bs {
				in.mustFree(t, b, stream)
			}
			in.mustVerify(t, fmt.Sprintf("frees on %s after the Stream closed", streamName(stream)))
		}
	})

	// An allocation on a view of a Stream that was closed fails with rmm.ErrClosed and changes
	// nothing, unless the resource ignores streams.
	t.Run("AllocateOnClosed", func(t tester) {
		defer s.hintOnFailure(t)
		in := s.newInstance(t, 0)
		keep := in.need(t, small, 0) // something live, so that "unchanged" means something
		si := in.mustAddStream(t)
		x := in.need(t, small, si) // the Stream has been used
		in.mustFree(t, x, si)
		if err := in.closeStream(si); err != nil {
			t.Fatalf("closing the Stream: %v", err)
		}
		// Allocate(0) returns (0, nil) and takes no memory on any stream (MemoryResource's
		// contract), a closed one included, and Deallocate(0, 0) frees it there.
		before := in.observe()
		if p, err := in.mr.Allocate(0, in.views[si]); p != 0 || err != nil {
			t.Fatalf("Allocate(0) on a closed Stream = (%#x, %v), want (0, nil)", uintptr(p), err)
		}
		if err := in.mr.Deallocate(0, 0, in.views[si]); err != nil {
			t.Fatalf("Deallocate(0, 0) on a closed Stream = %v, want nil", err)
		}
		if uerr := unchangedByZero(before, in.observe()); uerr != nil {
			t.Fatalf("Allocate(0) and Deallocate(0, 0) on a closed Stream: %v", uerr)
		}
		for _, n := range []int{small, large} {
			before := in.observe()
			_, liveBytes := in.liveCount()
			b, err, bad := in.allocate(n, si)
			call := fmt.Sprintf("Allocate(%d) on a closed Stream", n)
			switch {
			case bad != nil:
				t.Fatalf("%s: %v", call, bad)
			case err == nil && c.ignoresStreams:
				in.mustVerify(t, call)
				in.mustFree(t, b, si)
			case err == nil:
				in.mustFree(t, b, si)
				t.Fatalf("%s succeeded, want an error wrapping rmm.ErrClosed (set Options.IgnoresStreams if the resource does not look at streams)", call)
			case c.ignoresStreams && errors.Is(err, rmm.ErrOutOfMemory) && c.mayRunOut(liveBytes, n):
				// A resource that ignores streams answers as on any stream.
				if uerr := unchangedAccounting(before, in.observe()); uerr != nil {
					t.Fatalf("%s failed (%v), and: %v", call, err, uerr)
				}
			case !errors.Is(err, rmm.ErrClosed):
				t.Fatalf("%s = %v, want an error wrapping rmm.ErrClosed", call, err)
			default:
				if uerr := unchanged(before, in.observe()); uerr != nil {
					t.Fatalf("%s failed as it should (%v), but: %v", call, err, uerr)
				}
			}
		}
		// The resource keeps working.
		y := in.need(t, small, 0)
		in.mustVerify(t, "an allocation after one on a closed Stream")
		in.mustFree(t, y, 0)
		in.mustFree(t, keep, 0)
	})

	// A view made from a Stream's handle (rmm.NewStreamView), as of a stream some other library
	// owns: the resource cannot know when it is destroyed, so it must not use its handle after
	// the call that was given it. The Stream is closed (its handle destroyed) with memory freed
	// on the view still held by the resource; then other streams allocate and free, the resource
	// is released and torn down. On a GPU a later use of the handle crashes or is reported by
	// compute-sanitizer; without CUDA, handles are 0 and the view is DefaultStream.
	t.Run("ForeignHandle", func(t tester) {
		defer s.hintOnFailure(t)
		in := s.newInstance(t, 0)
		si := in.mustAddStream(t)
		view, err := rmm.NewStreamView(rmm.DeviceOf(in.mr), in.views[si].Handle())
		if err != nil {
			t.Fatalf("rmm.NewStreamView(%v, %#x): %v", rmm.DeviceOf(in.mr), in.views[si].Handle(), err)
		}
		in.views = append(in.views, view)
		fi := len(in.views) - 1
		sizes := []int{small, large, small, 256}
		var bs []*block
		for _, n := range sizes {
			bs = append(bs, in.need(t, min(n, c.maxSize), fi))
		}
		in.mustVerify(t, "allocations on the foreign view")
		for _, b := range bs {
			in.mustFree(t, b, fi)
		}
		in.mustVerify(t, "frees on the foreign view")
		if err := in.closeStream(si); err != nil {
			t.Fatalf("closing the Stream behind the foreign view: %v", err)
		}
		other := in.mustAddStream(t)
		for _, stream := range []int{other, 0} {
			bs = bs[:0]
			for _, n := range sizes {
				bs = append(bs, in.need(t, min(n, c.maxSize), stream))
			}
			in.mustVerify(t, fmt.Sprintf("allocations on %s after the foreign stream was destroyed", streamName(stream)))
			for _, b := range bs {
				in.mustFree(t, b, stream)
			}
		}
		if in.releaser != nil {
			if err := in.releaser.Release(); err != nil {
				t.Fatalf("Release after the foreign stream was destroyed: %v", err)
			}
			if err := in.checkReleased(); err != nil {
				t.Fatalf("%v", err)
			}
		}
		in.mustVerify(t, "everything freed")
		// The teardown (a cleanup) releases and closes the resource.
	})
}

// mustAddStream is addStream that ends t on an error.
func (in *instance) mustAddStream(t tester) int {
	t.Helper()
	i, err := in.addStream()
	if err != nil {
		t.Fatalf("%v", err)
	}
	return i
}
