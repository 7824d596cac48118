package fpwalk

import (
	"runtime"
	"strings"
	"testing"
	"unsafe"
)

// frame is what runtime.CallersFrames says of one logical frame.
type frame struct {
	Function string
	File     string
	Line     int
}

func frames(pcs []uintptr) []frame {
	var out []frame
	it := runtime.CallersFrames(pcs)
	for {
		f, more := it.Next()
		out = append(out, frame{f.Function, f.File, f.Line})
		if !more {
			return out
		}
	}
}

// capture takes the stack of its caller both ways, from the same call site.
//
//go:noinline
func capture(fp bool) ([]uintptr, bool) {
	pcs := make([]uintptr, 64)
	if fp {
		n, complete := Callers(2, pcs)
		return pcs[:n], complete
	}
	return pcs[:runtime.Callers(2, pcs)], true
}

//go:noinline
func outer(fp bool) ([]uintptr, bool) {
	return middle(fp) // inlined here
}

func middle(fp bool) ([]uintptr, bool) {
	return capture(fp)
}

// On a goroutine without wrappers on its stack, the PCs are the physical subset of
// runtime.Callers's and expand to the same frames: functions, files, lines, inlined calls
// included; the innermost is the caller of the function that called Callers (skip 2).
func TestCallersAsRuntime(t *testing.T) {
	type result struct {
		fp, rt   []uintptr
		complete bool
	}
	done := make(chan result)
	go func() {
		var r result
		for _, fp := range []bool{true, false} {
			pcs, complete := outer(fp)
			if fp {
				r.fp, r.complete = pcs, complete
			} else {
				r.rt = pcs
			}
		}
		done <- r
	}()
	r := <-done
	if !r.complete {
		t.Fatal("incomplete walk on a goroutine's stack")
	}
	want, got := frames(r.rt), frames(r.fp)
	t.Logf("runtime.Callers: %d PCs, %v", len(r.rt), want)
	t.Logf("Callers: %d PCs, %v", len(r.fp), got)
	if len(want) < 4 || !strings.HasSuffix(want[0].Function, ".middle") || !strings.HasSuffix(want[1].Function, ".outer") || want[len(want)-1].Function != "runtime.goexit" {
		t.Fatalf("unexpected stack from runtime.Callers: %v", want)
	}
	if len(got) != len(want) {
		t.Fatalf("%d frames, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("frame %d: %v, want %v", i, got[i], want[i])
		}
	}
	// middle is inlined into outer (unless inlining is off): one PC fewer than runtime.Callers,
	// the same innermost.
	if r.fp[0] != r.rt[0] {
		t.Errorf("innermost PC %#x, want %#x", r.fp[0], r.rt[0])
	}
	if f, _ := runtime.CallersFrames(r.rt[:1]).Next(); f.Func == nil {
		if len(r.fp) != len(r.rt)-1 {
			t.Errorf("%d PCs, want %d", len(r.fp), len(r.rt)-1)
		}
	} else {
		t.Log("middle is not inlined")
	}
}

// Callers fills pcs and no more; skip counts frames from its caller, 1.
func TestCallersLimitAndSkip(t *testing.T) {
	all := make([]uintptr, 64)
	n, complete := Callers(1, all)
	if !complete || n < 3 {
		t.Fatalf("n %d, complete %v", n, complete)
	}
	all = all[:n]
	if fn := runtime.FuncForPC(all[0] - 1); fn == nil || !strings.HasSuffix(fn.Name(), ".TestCallersLimitAndSkip") {
		t.Fatalf("frame 1 is %v, want the caller", fn)
	}
	for skip := 0; skip <= 3; skip++ {
		pcs := make([]uintptr, 2)
		n, complete := Callers(skip, pcs)
		if !complete || n != 2 {
			t.Fatalf("skip %d: n %d, complete %v", skip, n, complete)
		}
		from := max(skip, 1) - 1
		if pcs[1] != all[from+1] {
			t.Errorf("skip %d: %#x, want %#x", skip, pcs[1:], all[from+1:from+2])
		}
	}
	if n, complete := Callers(1, nil); n != 0 || !complete {
		t.Errorf("no room: n %d, complete %v", n, complete)
	}
	if n, complete := Callers(1000, all); n != 0 || !complete {
		t.Errorf("all skipped: n %d, complete %v", n, complete)
	}
}

// A chain of frames built by hand on the goroutine's stack: the walk follows it while each
// frame pointer passes the checks, and stops, incomplete, at the first that does not, without
// reading through it.
func TestCallersChecks(t *testing.T) {
	const pcA, pcB = 0x1111, 0x2222
	hi := stackHi()
	cases := []struct {
		name     string
		next     func(fp1 uintptr) uintptr // fp1's saved frame pointer
		complete bool
	}{
		{"zero ends the chain", func(uintptr) uintptr { return 0 }, true},
		{"not above", func(fp1 uintptr) uintptr { return fp1 }, false},
		{"below", func(fp1 uintptr) uintptr { return fp1 - 64 }, false},
		{"misaligned", func(fp1 uintptr) uintptr { return fp1 + 20 }, false},
		{"over 1 MiB above", func(fp1 uintptr) uintptr { return fp1 + 1<<20 + 64 }, false},
		{"at the top of the stack", func(uintptr) uintptr { return hi - 8 }, false},
		{"past the top of the stack", func(uintptr) uintptr { return hi + 4096 }, false},
		{"unmapped", func(uintptr) uintptr { return 8 }, false},
	}
	for _, c := range cases {
		// chain holds two frames: fp0 = &chain[0] and fp1 = &chain[2], each a saved frame
		// pointer and a return PC. Nothing between taking the addresses and the walk may grow
		// the stack (which would move the chain).
		var chain [4]uintptr
		var pcs [8]uintptr
		fp0 := uintptr(unsafe.Pointer(&chain[0]))
		chain[0], chain[1] = fp0+16, pcA
		chain[2], chain[3] = c.next(fp0+16), pcB
		n, complete := callersFrom(fp0, 2, pcs[:])
		if n != 2 || pcs[0] != pcA || pcs[1] != pcB || complete != c.complete {
			t.Errorf("%s: %#x, complete %v; want [0x1111 0x2222], complete %v", c.name, pcs[:n], complete, c.complete)
		}
	}
	// A first frame pointer that fails the checks is not read at all; 0 is the end.
	var pcs [8]uintptr
	for _, fp := range []uintptr{0, 8, hi, hi + 8, 0x10003} {
		if n, complete := callersFrom(fp, 2, pcs[:]); n != 0 || complete != (fp == 0) {
			t.Errorf("fp %#x: n %d, complete %v", fp, n, complete)
		}
	}
}
