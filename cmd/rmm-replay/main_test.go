package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gormm/rmm"
	"github.com/stretchr/testify/require"
)

var cupy = filepath.Join("..", "..", "testdata", "traces", "cupy_fft_linalg_2threads.csv.gz")

func TestReplaySimulated(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-simulate", "16GiB", "-expandable=false", "-passes", "2", cupy}, &out, &errOut), errOut.String())
	s := out.String()
	lines := strings.Split(s, "\n")
	require.Equal(t, "rmm-replay: PoolMemoryResource over SimulatedMemoryResource (17179869184 bytes, address-only)", lines[0])
	require.Contains(t, s, "events           110156 (allocations 55078, frees 55078, logged failures 0; 2 threads)\n")
	require.Contains(t, s, "failures         0\n")
	require.Contains(t, s, "peak live        618135910 bytes")
	// librmm's pool reaches 1579564032 bytes on this trace.
	require.Contains(t, s, "peak upstream    1579564032 bytes (1.471084 GiB), 2.555 x peak live\n")
	require.Contains(t, s, "left allocated   0 allocations, 0 bytes")
	require.Regexp(t, regexp.MustCompile(`median wall time \S+ \(\d+ ns/event\)`), s)
	require.Regexp(t, regexp.MustCompile(`passes           2, wall times \S+ \S+\n`), s)
}

// The default pool is the expandable one (on a GPU with virtual memory management, or over host
// memory); its figure on the CuPy trace is the same over the GPU, host memory and addresses only.
func TestReplayDefaultExpandable(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-simulate", "16GiB", "-passes", "3", cupy}, &out, &errOut), errOut.String())
	s := out.String()
	require.True(t, strings.HasPrefix(s, "rmm-replay: expandable PoolMemoryResource over SimulatedMemoryResource (17179869184 bytes, address-only)\n"), s)
	require.Contains(t, s, "peak upstream    771751936 bytes (736.000000 MiB), 1.249 x peak live\n")
}

// -expandable applies to -mr pool only: given with another resource it is an error, left out it
// is not.
func TestReplayExpandableOnlyWithPool(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run([]string{"-mr", "system", "-expandable", cupy}, &out, &errOut)
	require.ErrorContains(t, err, "-expandable works with -mr pool only")
	out.Reset()
	require.NoError(t, run([]string{"-mr", "system", cupy}, &out, &errOut))
	require.True(t, strings.HasPrefix(out.String(), "rmm-replay: SystemMemoryResource"), out.String())
}

func TestReplayDefaultResource(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{cupy}, &out, &errOut))
	first := strings.SplitN(out.String(), "\n", 2)[0]
	if rmm.CUDAAvailable() == nil {
		require.Regexp(t, `^rmm-replay: (expandable )?PoolMemoryResource over CudaMemoryResource on device 0 \(`, first)
	} else {
		require.True(t, strings.HasPrefix(first, "rmm-replay: expandable PoolMemoryResource over SystemMemoryResource (host memory; no CUDA device: "), first)
	}
	require.Contains(t, out.String(), "failures         0\n")
}

func TestReplayHelp(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run([]string{"-h"}, &out, &errOut)
	require.ErrorIs(t, err, flag.ErrHelp)
	require.Contains(t, errOut.String(), "usage: rmm-replay [flags] TRACE.csv[.gz]")
	require.Contains(t, errOut.String(), "-simulate")
	require.Contains(t, errOut.String(), "Sizes are bytes, or a number and a unit: 1073741824, 4GiB")
	require.Contains(t, errOut.String(), "3 when allocations failed")
}

func TestReplayFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "need exactly one trace file"},
		{[]string{"-mr", "bogus", cupy}, `-mr "bogus"`},
		{[]string{"-simulate", "lots", cupy}, `not a size: "lots"`},
		{[]string{"-simulate", "1GiB", "-mr", "cuda", cupy}, "-simulate works with -mr pool only"},
		{[]string{"-simulate", "0", cupy}, "-simulate 0: the simulated memory needs a positive size"},
		{[]string{"-passes", "0", cupy}, "-passes 0"},
		{[]string{"-initial", "100", cupy}, "not a multiple of 256"},
		{[]string{"no-such-file.csv"}, "no-such-file.csv"},
		{[]string{"-device", "7", cupy}, "-device 7"},
		{[]string{"-mr", "system", "-maximum", "1GiB", cupy}, "-maximum works with -mr pool only"},
		{[]string{"-mr", "system", "-initial", "1GiB", cupy}, "-initial works with -mr pool or async only"},
	} {
		var out, errOut bytes.Buffer
		err := run(tc.args, &out, &errOut)
		require.Error(t, err, "%v", tc.args)
		require.Contains(t, err.Error()+errOut.String(), tc.want, "%v", tc.args)
	}
}

// A cap below the trace's peak: the failures are counted and reported, and the replay ends with
// errFailures (exit status 3) unless -allow-failures.
func TestReplayCapped(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run([]string{"-simulate", "256MiB", "-v", cupy}, &out, &errOut)
	require.ErrorIs(t, err, errFailures)
	m := regexp.MustCompile(`failures         ([1-9]\d*)\n`).FindStringSubmatch(out.String())
	require.NotNil(t, m, out.String())
	require.Contains(t, err.Error(), m[1]+" allocations failed in 1 passes")
	require.Contains(t, errOut.String(), "out of memory")

	out.Reset()
	require.NoError(t, run([]string{"-simulate", "256MiB", "-allow-failures", cupy}, &out, &errOut))
	require.Contains(t, out.String(), "failures         "+m[1]+"\n")
}

// The plain pool's errors name the real upstream (no wrapper type of the command's).
func TestReplayInitialTooLarge(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run([]string{"-expandable=false", "-initial", "1TiB", "-simulate", "1GiB", cupy}, &out, &errOut)
	require.ErrorIs(t, err, rmm.ErrOutOfMemory)
	require.NotContains(t, err.Error(), "peakResource")
	require.Contains(t, err.Error(), "SimulatedMemoryResource")
}

func TestMedianOf(t *testing.T) {
	ms := time.Millisecond
	require.Equal(t, 5*ms, medianOf([]time.Duration{5 * ms}))
	require.Equal(t, 2150*time.Microsecond, medianOf([]time.Duration{2200 * time.Microsecond, 2100 * time.Microsecond}))
	require.Equal(t, 3*ms, medianOf([]time.Duration{9 * ms, 1 * ms, 3 * ms}))
	require.Equal(t, 5*ms, medianOf([]time.Duration{9 * ms, 1 * ms, 4 * ms, 6 * ms}))
}

// fixedAddrs hands out the addresses it is given, in order.
type fixedAddrs struct {
	rmm.MemoryResource
	next []rmm.DevicePtr
}

func (f *fixedAddrs) Allocate(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
	p := f.next[0]
	f.next = f.next[1:]
	return p, nil
}

func (f *fixedAddrs) Deallocate(p rmm.DevicePtr, n int, s rmm.StreamView) error { return nil }

func TestFloorResourceCountsPagesHoldingLiveBytes(t *testing.T) {
	const mib = 1 << 20
	up := &fixedAddrs{MemoryResource: rmm.NewSystemMemoryResource(), next: []rmm.DevicePtr{mib, 0x280000, 4 * mib, 16 * mib, 0}}
	r := &floorResource{MemoryResource: up, page: mib, refs: map[uintptr]int32{}}
	s := rmm.DefaultStream
	step := func(live, peak int) {
		t.Helper()
		require.Equal(t, live, r.live, "pages live")
		require.Equal(t, peak, r.peak, "peak pages")
	}
	a, _ := r.Allocate(3*mib/2, s) // pages 1, 2
	step(2, 2)
	b, _ := r.Allocate(mib/4, s) // page 2, shared with a
	step(2, 2)
	c, _ := r.Allocate(mib, s) // page 4 exactly
	step(3, 3)
	require.NoError(t, r.Deallocate(a, 3*mib/2, s)) // page 2 still holds b
	step(2, 3)
	require.NoError(t, r.Deallocate(b, mib/4, s))
	step(1, 3)
	d, _ := r.Allocate(3*mib, s) // pages 16-18
	step(4, 4)
	z, _ := r.Allocate(mib, s) // a null pointer holds no page
	require.Zero(t, z)
	step(4, 4)
	require.NoError(t, r.Deallocate(z, mib, s))
	step(4, 4)
	require.NoError(t, r.Deallocate(c, mib, s))
	require.NoError(t, r.Deallocate(d, 3*mib, s))
	step(0, 4)
	require.Empty(t, r.refs)
}

func TestReplayFloor(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-simulate", "16GiB", "-expandable", "-floor", "2MiB", cupy}, &out, &errOut), errOut.String())
	m := regexp.MustCompile(`page floor       (\d+) bytes \(.*\), ([0-9.]+) x peak live: the most 2.0 MiB pages holding live bytes at once\n`).FindStringSubmatch(out.String())
	require.NotNil(t, m, out.String())
	floor, _ := strconv.Atoi(m[1])
	require.Zero(t, floor%(2<<20))
	require.GreaterOrEqual(t, floor, 618135910, "at least the peak live bytes")
	up := regexp.MustCompile(`peak upstream    (\d+) bytes`).FindStringSubmatch(out.String())
	require.NotNil(t, up)
	mapped, _ := strconv.Atoi(up[1])
	require.LessOrEqual(t, floor, mapped, "at most what the pool mapped")

	for _, bad := range []string{"0", "-1", "4095", "abc"} {
		err := run([]string{"-floor", bad, cupy}, &out, &errOut)
		require.ErrorIs(t, err, errUsage, "-floor %s", bad)
	}
}

// -json writes one object with the text report's figures, parsed back here; failures still end
// with errFailures after it.
func TestReplayJSON(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-json", "-simulate", "16GiB", "-passes", "2", cupy}, &out, &errOut), errOut.String())
	var j replayJSON
	require.NoError(t, json.Unmarshal(out.Bytes(), &j), out.String())
	require.Equal(t, 110156, j.Events)
	require.Equal(t, 55078, j.Allocations)
	require.Equal(t, 2, j.Passes)
	require.Len(t, j.WallNs, 2)
	require.Zero(t, j.Failures)
	require.Equal(t, int64(618135910), j.PeakLiveBytes)
	require.Equal(t, int64(771751936), j.PeakReservedBytes)
	require.InDelta(t, 1.249, j.ReservedOverLive, 0.0005)
	require.NotNil(t, j.PoolAtEnd)
	require.Equal(t, 771751936, j.PoolAtEnd.PeakPoolSize)
	require.Positive(t, j.NsPerEvent)

	out.Reset()
	err := run([]string{"-json", "-simulate", "256MiB", cupy}, &out, &errOut)
	require.ErrorIs(t, err, errFailures)
	require.NoError(t, json.Unmarshal(out.Bytes(), &j))
	require.Positive(t, j.Failures)
}

// The progress line is for terminals only: a buffer (or a file, or a pipe) gets none.
func TestReplayNoProgressOffTerminal(t *testing.T) {
	var out, errOut bytes.Buffer
	stop := startProgress(&errOut, 3, func() int { return 1 })
	time.Sleep(1100 * time.Millisecond)
	stop()
	stop() // twice is harmless
	require.Empty(t, errOut.String())
	require.NoError(t, run([]string{"-simulate", "16GiB", cupy}, &out, &errOut))
	require.NotContains(t, errOut.String(), "pass 1 of")
}
