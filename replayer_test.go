package rmm

import (
	"fmt"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// Replaying each bundled trace through a pool (initial 0, no maximum) over an address-only
// upstream gives no failure, the trace's peak live bytes, and exactly the pool size librmm's pool
// reaches on the same trace (notes/benchmarks.md, W4): the same growth and best-fit rules.
func TestReplayBundledTraces(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	want := map[string]struct {
		peakLive, poolSize int64
		left               int
	}{
		"resnet50_train_b64_fp32.csv.gz":       {10891909120, 14596177920, 3},
		"gpt2s_train_adamw_seq512_bf16.csv.gz": {8113058504, 9880928256, 3},
		"bert_base_infer_dynamic_fp16.csv.gz":  {3076346368, 6000869376, 2},
		"cupy_fft_linalg_2threads.csv.gz":      {618135910, 1579564032, 0},
	}
	for name, w := range want {
		t.Run(strings.Split(name, ".")[0], func(t *testing.T) {
			shortTraces(t, strings.Split(name, ".")[0], "bert_base_infer_dynamic_fp16", "cupy_fft_linalg_2threads") // failed allocations; two threads
			events, err := ReadLogFile(filepath.Join("testdata", "traces", name))
			require.NoError(t, err)
			sim, _ := NewSimulatedMemoryResource(1 << 40)
			pool, err := NewPoolMemoryResource(sim, nil)
			require.NoError(t, err)
			r, err := Replay(events, pool, nil)
			require.NoError(t, err)
			require.Zero(t, r.Failures, "no allocation fails")
			require.Zero(t, r.UnmatchedFrees)
			require.Zero(t, r.MismatchedFrees, "the recorders log a free with its allocation's size")
			require.Zero(t, r.DuplicateAllocations)
			require.Equal(t, w.peakLive, r.PeakLiveBytes)
			require.Equal(t, w.left, r.LeftAllocations)
			require.Equal(t, len(events), r.Events)
			require.Equal(t, int(w.poolSize), pool.PoolSize(), "librmm's pool ends at this size")
			require.NoError(t, pool.CheckInvariants())
			require.Zero(t, pool.Stats().LiveAllocations, "leftovers are freed after the replay")
		})
	}
}

// The smallest trace over real host memory.
func TestReplayOverSystemMemory(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	events, err := ReadLogFile(filepath.Join("testdata", "traces", "cupy_fft_linalg_2threads.csv.gz"))
	require.NoError(t, err)
	pool, err := NewPoolMemoryResource(NewSystemMemoryResource(), nil)
	require.NoError(t, err)
	defer pool.Close()
	r, err := Replay(events, pool, nil)
	require.NoError(t, err)
	require.Zero(t, r.Failures)
	require.Equal(t, 2, r.Threads)
	require.NoError(t, pool.CheckInvariants())
}

// orderRecorder records the sizes it is asked to allocate and free, in call order.
type orderRecorder struct {
	mu    sync.Mutex
	inner MemoryResource
	calls []string
	fail  map[int]bool
}

func (r *orderRecorder) Allocate(n int, s StreamView) (DevicePtr, error) {
	r.mu.Lock()
	r.calls = append(r.calls, fmt.Sprintf("a%d", n))
	fail := r.fail[n]
	r.mu.Unlock()
	if fail {
		return 0, outOfMemory("orderRecorder", n, nil)
	}
	return r.inner.Allocate(n, s)
}

func (r *orderRecorder) Deallocate(p DevicePtr, n int, s StreamView) error {
	r.mu.Lock()
	r.calls = append(r.calls, fmt.Sprintf("f%d", n))
	r.mu.Unlock()
	return r.inner.Deallocate(p, n, s)
}

// Events of three logged threads are replayed in the log's global order; failure lines are
// skipped; a free of an unknown pointer is skipped; a replayed allocation that fails is counted
// and its free skipped.
func TestReplayGlobalOrder(t *testing.T) {
	log := LogHeader + "\n" +
		"1,00:00:00.000001,allocate,0x1000,100,0\n" +
		"2,00:00:00.000002,allocate,0x2000,200,0x10\n" +
		"3,00:00:00.000003,allocate,0x3000,300,0\n" +
		"1,00:00:00.000004,free,0x2000,200,0\n" +
		"3,00:00:00.000005,allocate failure,(nil),999,0\n" +
		"2,00:00:00.000006,allocate,0x4000,400,0x10\n" +
		"2,00:00:00.000007,free,0x9999,50,0x10\n" +
		"1,00:00:00.000008,allocate,0x5000,500,0\n" +
		"3,00:00:00.000009,free,0x1000,100,0\n" +
		"1,00:00:00.000010,free,0x5000,500,0\n" +
		"2,00:00:00.000011,allocate,0x2000,600,0\n"
	events, err := ReadLog(strings.NewReader(log))
	require.NoError(t, err)
	for i := 0; i < 20; i++ {
		rec := &orderRecorder{inner: NewSystemMemoryResource(), fail: map[int]bool{500: true}}
		r, err := Replay(events, rec, nil)
		require.NoError(t, err)
		require.Equal(t, []string{"a100", "a200", "a300", "f200", "a400", "a500", "f100", "a600",
			// leftovers freed after the timed part, in log order
			"f300", "f400", "f600"}, rec.calls)
		require.Equal(t, 3, r.Threads)
		require.Equal(t, 1, r.LoggedFailures)
		require.Equal(t, 1, r.Failures)
		require.Equal(t, 1, r.UnmatchedFrees)
		require.Equal(t, 6, r.Allocations)
		require.Equal(t, 3, r.Frees)
		require.Equal(t, 3, r.LeftAllocations)
		require.Equal(t, int64(1300), r.LeftBytes)
		require.Equal(t, int64(100+300+400+500), r.PeakLiveBytes)
	}
}

// With Serial, the same log gives the same calls in the same order, all made from the goroutine
// that called Replay (its stack holds this test), and the same counts; without it, from the
// goroutines of the logged threads.
func TestReplaySerial(t *testing.T) {
	log := LogHeader + "\n" +
		"1,00:00:00.000001,allocate,0x1000,100,0\n" +
		"2,00:00:00.000002,allocate,0x2000,200,0x10\n" +
		"1,00:00:00.000003,free,0x2000,200,0\n" +
		"2,00:00:00.000004,allocate,0x3000,300,0x10\n" +
		"2,00:00:00.000005,free,0x1000,100,0x10\n"
	events, err := ReadLog(strings.NewReader(log))
	require.NoError(t, err)
	for _, serial := range []bool{true, false} {
		rec := &goroutineRecorder{orderRecorder: orderRecorder{inner: NewSystemMemoryResource()}, mark: "TestReplaySerial"}
		r, err := Replay(events, rec, &ReplayOptions{Serial: serial})
		require.NoError(t, err)
		require.Equal(t, []string{"a100", "a200", "f200", "a300", "f100", "f300"}, rec.calls)
		require.Equal(t, 2, r.Threads, "the logged threads")
		require.Equal(t, 1, r.LeftAllocations)
		require.Equal(t, int64(300), r.LeftBytes)
		// The timed calls (the last is the leftover's free, made by Replay itself).
		require.Equal(t, []bool{serial, serial, serial, serial, serial}, rec.onCaller[:5], "serial %v", serial)
	}
}

// goroutineRecorder is an orderRecorder that also records, for each call, whether the calling
// goroutine's stack holds the function named mark.
type goroutineRecorder struct {
	orderRecorder
	mark     string
	onCaller []bool
}

func (r *goroutineRecorder) note() {
	buf := make([]byte, 64<<10)
	buf = buf[:runtime.Stack(buf, false)]
	r.mu.Lock()
	r.onCaller = append(r.onCaller, strings.Contains(string(buf), r.mark))
	r.mu.Unlock()
}

func (r *goroutineRecorder) Allocate(n int, s StreamView) (DevicePtr, error) {
	r.note()
	return r.orderRecorder.Allocate(n, s)
}

func (r *goroutineRecorder) Deallocate(p DevicePtr, n int, s StreamView) error {
	r.note()
	return r.orderRecorder.Deallocate(p, n, s)
}

// A pointer the log allocates twice without a free in between leaves the first allocation live;
// the free of a zero-byte allocation, (nil), is a free, not an unmatched one.
func TestReplayAccountingOddLogs(t *testing.T) {
	log := LogHeader + "\n" +
		"1,00:00:00.000001,allocate,0x200,100,0\n" +
		"1,00:00:00.000002,allocate,0x200,300,0\n" +
		"1,00:00:00.000003,free,0x200,300,0\n" +
		"1,00:00:00.000004,allocate,(nil),0,0\n" +
		"1,00:00:00.000005,free,(nil),0,0\n"
	events, err := ReadLog(strings.NewReader(log))
	require.NoError(t, err)
	rec := &orderRecorder{inner: NewSystemMemoryResource()}
	r, err := Replay(events, rec, nil)
	require.NoError(t, err)
	require.Equal(t, 1, r.LeftAllocations)
	require.Equal(t, int64(100), r.LeftBytes)
	require.Zero(t, r.UnmatchedFrees)
	require.Equal(t, 2, r.Frees)
	require.Equal(t, int64(400), r.PeakLiveBytes)
	require.Equal(t, []string{"a100", "a300", "f300", "a0", "f100"}, rec.calls)
}

// A free whose logged size is not its allocation's frees with the allocation's size, and a
// pointer allocated again while live replaces the earlier allocation, which is left live to the
// end and freed with the leftovers: both are counted.
func TestReplayMismatchedFreesAndDuplicateAllocations(t *testing.T) {
	log := LogHeader + "\n" +
		"1,00:00:00.000001,allocate,0x100,100,0\n" +
		"1,00:00:00.000002,free,0x100,150,0\n" + // mismatched: freed as 100
		"1,00:00:00.000003,allocate,0x200,200,0\n" +
		"1,00:00:00.000004,allocate,0x200,300,0\n" + // duplicate: the 200 is left live
		"1,00:00:00.000005,free,0x200,300,0\n" +
		"1,00:00:00.000006,allocate,0x300,400,0\n" +
		"1,00:00:00.000007,free,0x300,50,0\n" + // mismatched: freed as 400
		"1,00:00:00.000008,allocate,(nil),0,0\n" +
		"1,00:00:00.000009,free,(nil),0,0\n"
	events, err := ReadLog(strings.NewReader(log))
	require.NoError(t, err)
	for _, serial := range []bool{false, true} {
		rec := &orderRecorder{inner: NewSystemMemoryResource()}
		r, err := Replay(events, rec, &ReplayOptions{Serial: serial})
		require.NoError(t, err)
		require.Equal(t, []string{"a100", "f100", "a200", "a300", "f300", "a400", "f400", "a0", "f200"}, rec.calls)
		require.Equal(t, 2, r.MismatchedFrees)
		require.Equal(t, 1, r.DuplicateAllocations)
		require.Zero(t, r.UnmatchedFrees)
		require.Equal(t, 4, r.Frees)
		require.Equal(t, 5, r.Allocations)
		require.Equal(t, 1, r.LeftAllocations)
		require.Equal(t, int64(200), r.LeftBytes)
		require.Equal(t, int64(600), r.PeakLiveBytes, "live bytes count the allocated sizes")
	}
}

// Many logged threads, events interleaved round-robin: the global order holds.
func TestReplayManyThreads(t *testing.T) {
	const threads, per = 64, 40
	var b strings.Builder
	b.WriteString(LogHeader + "\n")
	var want []string
	for k := 0; k < per; k++ {
		for th := 0; th < threads; th++ {
			size := 256 * (th + 1)
			if k%2 == 0 {
				fmt.Fprintf(&b, "%d,00:00:00.000001,allocate,0x%x,%d,0\n", th+1, 0x10000*(th+1), size)
				want = append(want, fmt.Sprintf("a%d", size))
			} else {
				fmt.Fprintf(&b, "%d,00:00:00.000001,free,0x%x,%d,0\n", th+1, 0x10000*(th+1), size)
				want = append(want, fmt.Sprintf("f%d", size))
			}
		}
	}
	events, err := ReadLog(strings.NewReader(b.String()))
	require.NoError(t, err)
	rec := &orderRecorder{inner: NewSystemMemoryResource()}
	r, err := Replay(events, rec, nil)
	require.NoError(t, err)
	require.Equal(t, threads, r.Threads)
	require.Equal(t, want, rec.calls)
	require.Zero(t, r.LeftAllocations)
}

// AfterEvent sees every event once, in the log's order, after the resource has handled it, with
// the live bytes the log holds then (skipped lines and failed allocations included); its calls
// from the three goroutines are ordered (the race detector would see unordered writes to got).
func TestReplayAfterEvent(t *testing.T) {
	log := LogHeader + "\n" +
		"1,00:00:00.000001,allocate,0x1000,100,0\n" +
		"2,00:00:00.000002,allocate,0x2000,200,0x10\n" +
		"3,00:00:00.000003,allocate,0x3000,300,0\n" +
		"1,00:00:00.000004,free,0x2000,200,0\n" +
		"3,00:00:00.000005,allocate failure,(nil),999,0\n" +
		"2,00:00:00.000006,allocate,0x4000,400,0x10\n" +
		"2,00:00:00.000007,free,0x9999,50,0x10\n" +
		"1,00:00:00.000008,allocate,0x5000,500,0\n" +
		"3,00:00:00.000009,free,0x1000,100,0\n" +
		"1,00:00:00.000010,free,0x5000,500,0\n" +
		"2,00:00:00.000011,allocate,0x2000,600,0\n"
	events, err := ReadLog(strings.NewReader(log))
	require.NoError(t, err)
	type call struct {
		i         int
		live      int64
		resCalled int // calls the resource had had
	}
	for range 20 {
		rec := &orderRecorder{inner: NewSystemMemoryResource(), fail: map[int]bool{500: true}}
		var got []call
		r, err := Replay(events, rec, &ReplayOptions{AfterEvent: func(i int, live int64) {
			rec.mu.Lock()
			n := len(rec.calls)
			rec.mu.Unlock()
			got = append(got, call{i, live, n})
		}})
		require.NoError(t, err)
		require.Equal(t, []call{
			{0, 100, 1}, {1, 300, 2}, {2, 600, 3}, {3, 400, 4},
			{4, 400, 4}, // a logged failure: skipped
			{5, 800, 5},
			{6, 800, 5},  // an unmatched free: skipped
			{7, 1300, 6}, // fails in the replay, live in the log
			{8, 1200, 7},
			{9, 700, 7}, // the free of the failed allocation: skipped
			{10, 1300, 8},
		}, got)
		var peak int64
		for _, c := range got {
			peak = max(peak, c.live)
		}
		require.Equal(t, r.PeakLiveBytes, peak)
	}
}
