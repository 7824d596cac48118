package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
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
	require.NoError(t, run([]string{"-simulate", "16GiB", "-mr", "plain", "-passes", "2", cupy}, &out, &errOut), errOut.String())
	s := out.String()
	lines := strings.Split(s, "\n")
	require.Equal(t, "rmm-replay: PoolMemoryResource over SimulatedMemoryResource (17179869184 bytes, address-only)", lines[0])
	require.Contains(t, s, "events           110156 (allocations 55078, frees 55078, logged failures 0; 2 threads)\n")
	require.Contains(t, s, "failures         0\n")
	require.Contains(t, s, "peak live        618135910 bytes")
	// librmm's pool reaches 1579564032 bytes on this trace.
	require.Contains(t, s, "peak reserved    1579564032 bytes (1.471 GiB), 2.555 x peak live\n")
	require.Contains(t, s, "left allocated   0 allocations, 0 bytes")
	require.Regexp(t, regexp.MustCompile(`median wall time \S+ \(\d+ ns/event\)`), s)
	require.Regexp(t, regexp.MustCompile(`passes           2, wall times \S+ \S+\n`), s)
}

// -serial replays the two-thread trace from one goroutine: the same calls in the same order, so
// the same footprint (1.249 on the expandable pool, as in TestReplaySeveralResources), said in
// the report and in -json.
func TestReplaySerialFlag(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-simulate", "16GiB", "-mr", "expandable", "-serial", "-passes", "2", cupy}, &out, &errOut), errOut.String())
	s := out.String()
	require.Contains(t, s, "events           110156 (allocations 55078, frees 55078, logged failures 0; 2 threads, replayed from one goroutine)\n")
	require.Contains(t, s, "peak reserved    771751936 bytes (736 MiB), 1.249 x peak live\n")
	out.Reset()
	require.NoError(t, run([]string{"-json", "-simulate", "16GiB", "-serial", cupy}, &out, &errOut), errOut.String())
	var j struct {
		Threads int  `json:"threads"`
		Serial  bool `json:"serial"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &j), out.String())
	require.Equal(t, 2, j.Threads)
	require.True(t, j.Serial)
}

// The default pool is the package's default, a stitching pool (on a GPU with virtual memory
// management, or over host memory); its figure on the CuPy trace is the same over the GPU, host
// memory and addresses only.
func TestReplayDefaultStitching(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-simulate", "16GiB", "-passes", "3", cupy}, &out, &errOut), errOut.String())
	s := out.String()
	require.True(t, strings.HasPrefix(s, "rmm-replay: stitching PoolMemoryResource over SimulatedMemoryResource (17179869184 bytes, address-only)\n"), s)
	require.Contains(t, s, "peak reserved    645922816 bytes (616 MiB), 1.045 x peak live\n")
}

// The pool is picked by -mr alone: the flags that chose it before are unknown (a bad command
// line), and pool is the same resource as the kind it stands for.
func TestReplayNoPoolFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-stitch", cupy},
		{"-expandable", cupy},
		{"-expandable=false", cupy},
		{"-mr", "expandable", "-stitch", cupy},
	} {
		var out, errOut bytes.Buffer
		err := run(args, &out, &errOut)
		require.ErrorIs(t, err, errUsage, "%v", args)
		require.Equal(t, 2, exitStatus(err), "%v", args)
		require.Contains(t, errOut.String(), "flag provided but not defined: -"+strings.TrimPrefix(strings.SplitN(args[len(args)-2], "=", 2)[0], "-"), "%v", args)
		require.Empty(t, out.String(), "%v", args)
	}
}

func TestReplayDefaultResource(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{cupy}, &out, &errOut))
	first := strings.SplitN(out.String(), "\n", 2)[0]
	if rmm.CUDAAvailable() == nil {
		// librmm's pool where the GPU lacks virtual memory management.
		require.Regexp(t, `^rmm-replay: (stitching )?PoolMemoryResource over CudaMemoryResource on device 0 \(`, first)
	} else {
		require.True(t, strings.HasPrefix(first, "rmm-replay: stitching PoolMemoryResource over SystemMemoryResource (host memory; no CUDA device: "), first)
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
		{[]string{"-simulate", "1GiB", "-mr", "cuda", cupy}, "-simulate works with the pools only"},
		{[]string{"-simulate", "0", cupy}, "-simulate 0: the simulated memory needs a positive size"},
		{[]string{"-passes", "0", cupy}, "-passes 0"},
		{[]string{"-initial", "100", cupy}, "-initial 100: a pool's sizes must be multiples of 256 bytes"},
		{[]string{"-maximum", "1000", cupy}, "-maximum 1000: a pool's sizes must be multiples of 256 bytes"},
		{[]string{"-mr", "plain,expandable", "-initial", "1KiB", "-maximum", "1.5KB", cupy}, "-maximum 1500: a pool's sizes must be multiples of 256 bytes"},
		{[]string{"-initial", "2GiB", "-maximum", "1GiB", cupy}, "-initial 2147483648 (2 GiB) exceeds -maximum 1073741824 (1 GiB)"},
		{[]string{"no-such-file.csv"}, "no-such-file.csv"},
		{[]string{"-device", "7", cupy}, "-device 7"},
		{[]string{"-mr", "system", "-maximum", "1GiB", cupy}, "-maximum works with the pools only"},
		{[]string{"-mr", "system", "-initial", "1GiB", cupy}, "-initial works with the pools or async only"},
		{[]string{"-mr", "nosuch", cupy}, `-mr "nosuch": want pool, stitching, expandable, plain, cuda, async, managed or system`},
		{[]string{"-mr", "plain,nosuch", cupy}, `-mr "nosuch"`},
		{[]string{"-mr", "plain,", cupy}, `-mr "plain,": an empty name in the list`},
		{[]string{"-mr", "plain,plain", cupy}, "-mr plain,plain: plain is named twice"},
		{[]string{"-mr", "pool,stitching", cupy}, "-mr pool,stitching: pool and stitching are the same resource (pool is the default pool, a stitching pool)"},
		{[]string{"-mr", "plain,stitching,pool", cupy}, "-mr plain,stitching,pool: stitching and pool are the same resource"},
		{[]string{"-mr", "stitching,stitching", cupy}, "stitching is named twice"},
		{[]string{"-mr", "plain,system", "-simulate", "1GiB", cupy}, "-simulate works with the pools only: -mr pool, stitching, expandable or plain (got -mr system)"},
		{[]string{"-mr", "plain,async", "-maximum", "1GiB", cupy}, "-maximum works with the pools only: -mr pool, stitching, expandable or plain (got -mr async)"},
		{[]string{"-plot", "x.gif", cupy}, "-plot x.gif: want a file name ending in .svg or .png"},
	} {
		var out, errOut bytes.Buffer
		err := run(tc.args, &out, &errOut)
		require.Error(t, err, "%v", tc.args)
		require.Contains(t, err.Error()+errOut.String(), tc.want, "%v", tc.args)
		want := 2 // a bad command line
		if tc.want == "no-such-file.csv" {
			want = 1 // the trace cannot be read
		}
		require.Equal(t, want, exitStatus(err), "%v: %v", tc.args, err)
		require.Empty(t, out.String(), "%v: nothing replayed", tc.args)
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
	require.Contains(t, err.Error(), m[1]+" allocations failed in one pass")
	require.Contains(t, errOut.String(), "out of memory")

	out.Reset()
	require.NoError(t, run([]string{"-simulate", "256MiB", "-allow-failures", cupy}, &out, &errOut))
	require.Contains(t, out.String(), "failures         "+m[1]+"\n")

	out.Reset()
	err = run([]string{"-simulate", "256MiB", "-passes", "2", cupy}, &out, &errOut)
	require.ErrorIs(t, err, errFailures)
	require.Regexp(t, `[1-9]\d* allocations failed over 2 passes that the trace`, err.Error())
}

// The plain pool's errors name the real upstream (no wrapper type of the command's).
func TestReplayInitialTooLarge(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run([]string{"-mr", "plain", "-initial", "1TiB", "-simulate", "1GiB", cupy}, &out, &errOut)
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
	require.NoError(t, run([]string{"-simulate", "16GiB", "-mr", "expandable", "-floor", "2MiB", cupy}, &out, &errOut), errOut.String())
	m := regexp.MustCompile(`page floor       (\d+) bytes \(.*\), ([0-9.]+) x peak live: the most 2 MiB pages holding live bytes at once\n`).FindStringSubmatch(out.String())
	require.NotNil(t, m, out.String())
	floor, _ := strconv.Atoi(m[1])
	require.Zero(t, floor%(2<<20))
	require.GreaterOrEqual(t, floor, 618135910, "at least the peak live bytes")
	up := regexp.MustCompile(`peak reserved    (\d+) bytes`).FindStringSubmatch(out.String())
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
	require.Equal(t, "pool", j.Name)
	require.Equal(t, "stitching PoolMemoryResource over SimulatedMemoryResource (17179869184 bytes, address-only)", j.Resource)
	require.Equal(t, int64(618135910), j.PeakLiveBytes)
	require.Equal(t, int64(645922816), j.PeakReservedBytes)
	require.InDelta(t, 1.045, j.ReservedOverLive, 0.0005)
	require.NotNil(t, j.PoolAtEnd)
	require.Equal(t, 645922816, j.PoolAtEnd.PeakPoolSize)
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
	stop := startProgress(&errOut, "", 3, func() int { return 1 })
	time.Sleep(1100 * time.Millisecond)
	stop()
	stop() // twice is harmless
	require.Empty(t, errOut.String())
	require.NoError(t, run([]string{"-simulate", "16GiB", cupy}, &out, &errOut))
	require.NotContains(t, errOut.String(), "pass 1 of")
}

// Several resources in one run: a row each in one table, a resource line each before it, and one
// JSON list; the trace's figures are the same in every row.
func TestReplaySeveralResources(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-simulate", "16GiB", "-mr", "plain,expandable", "-floor", "2MiB", cupy}, &out, &errOut), errOut.String())
	s := out.String()
	lines := strings.Split(s, "\n")
	require.Equal(t, "rmm-replay: plain       PoolMemoryResource over SimulatedMemoryResource (17179869184 bytes, address-only)", lines[0])
	require.Equal(t, "rmm-replay: expandable  expandable PoolMemoryResource over SimulatedMemoryResource (17179869184 bytes, address-only)", lines[1])
	require.Contains(t, s, "events           110156 (allocations 55078, frees 55078, logged failures 0; 2 threads)\n")
	require.Contains(t, s, "passes           1 on each resource\n")
	require.Contains(t, s, "peak live        618135910 bytes")
	require.Contains(t, s, "\nresource    failures  wall time  ns/event  peak live  peak reserved  reserved/live  page floor  floor/live\n")
	rows := map[string][]string{}
	for _, l := range lines {
		if f := strings.Fields(l); len(f) == 12 && (f[0] == "plain" || f[0] == "expandable") {
			rows[f[0]] = f
		}
	}
	require.Len(t, rows, 2, s)
	// name, failures, wall, ns/event, peak live (number and unit), reserved (number and unit),
	// ratio, page floor (number and unit), ratio: Fields splits "589.5 MiB" in two.
	require.Equal(t, []string{"plain", "0"}, rows["plain"][:2])
	require.Equal(t, []string{"589.5", "MiB", "1.471", "GiB", "2.555"}, rows["plain"][4:9])
	require.Equal(t, []string{"expandable", "0"}, rows["expandable"][:2])
	require.Equal(t, []string{"589.5", "MiB", "736.0", "MiB", "1.249"}, rows["expandable"][4:9])
	for _, r := range rows {
		ratio, err := strconv.ParseFloat(r[11], 64)
		require.NoError(t, err)
		require.GreaterOrEqual(t, ratio, 1.0, "the page floor holds at least the live bytes")
		require.Equal(t, "MiB", r[10])
	}

	out.Reset()
	require.NoError(t, run([]string{"-json", "-simulate", "16GiB", "-mr", "plain,expandable", "-passes", "2", cupy}, &out, &errOut), errOut.String())
	var list []replayJSON
	require.NoError(t, json.Unmarshal(out.Bytes(), &list), out.String())
	require.Len(t, list, 2)
	require.Equal(t, "plain", list[0].Name)
	require.Equal(t, "PoolMemoryResource over SimulatedMemoryResource (17179869184 bytes, address-only)", list[0].Resource)
	require.Equal(t, "expandable", list[1].Name)
	for _, j := range list {
		require.Equal(t, 110156, j.Events, j.Name)
		require.Equal(t, 55078, j.Allocations, j.Name)
		require.Equal(t, 2, j.Passes, j.Name)
		require.Len(t, j.WallNs, 2, j.Name)
		require.Zero(t, j.Failures, j.Name)
		require.Equal(t, int64(618135910), j.PeakLiveBytes, j.Name)
		require.NotNil(t, j.PoolAtEnd, j.Name)
	}
	require.Equal(t, list[0].PeakLiveBytes, list[1].PeakLiveBytes)
	require.Equal(t, int64(1579564032), list[0].PeakReservedBytes, "librmm's pool")
	require.Equal(t, int64(771751936), list[1].PeakReservedBytes, "the expandable pool")

	// Over host memory, with the resource that counts what it hands out.
	out.Reset()
	require.NoError(t, run([]string{"-json", "-mr", "system,pool", cupy}, &out, &errOut), errOut.String())
	require.NoError(t, json.Unmarshal(out.Bytes(), &list), out.String())
	require.Equal(t, []string{"system", "pool"}, []string{list[0].Name, list[1].Name})
	require.Equal(t, list[0].PeakLiveBytes, list[0].PeakReservedBytes, "system holds what is live")
	require.Equal(t, list[0].PeakLiveBytes, list[1].PeakLiveBytes)
}

// Failures on any of the resources end the run with errFailures (exit status 3) after the report,
// naming the resources they came from, unless -allow-failures.
func TestReplaySeveralCapped(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run([]string{"-json", "-simulate", "256MiB", "-mr", "plain,expandable", cupy}, &out, &errOut)
	require.ErrorIs(t, err, errFailures)
	require.Equal(t, 3, exitStatus(err))
	var list []replayJSON
	require.NoError(t, json.Unmarshal(out.Bytes(), &list), out.String())
	require.Len(t, list, 2)
	require.Positive(t, list[0].Failures)
	require.Positive(t, list[1].Failures)
	require.Contains(t, err.Error(), fmt.Sprintf("%d allocations failed in one pass (%d on plain, %d on expandable)", list[0].Failures+list[1].Failures, list[0].Failures, list[1].Failures))

	out.Reset()
	err = run([]string{"-simulate", "256MiB", "-mr", "plain,expandable", "-allow-failures", cupy}, &out, &errOut)
	require.NoError(t, err)
	require.Equal(t, 0, exitStatus(err))
	require.Contains(t, out.String(), fmt.Sprintf("plain: %d allocations failed", list[0].Failures))
}

// Without a GPU, a resource that needs one, alone, fails the run before anything is replayed
// (before the trace is read: here there is none), naming it; among others it is left out with a
// note on standard error and the others run on host memory.
func TestReplayNeedsGPU(t *testing.T) {
	if rmm.CUDAAvailable() == nil {
		t.Skip("a CUDA device is here")
	}
	msg := func(name string) string {
		return `-mr ` + name + `: \w+MemoryResource needs a CUDA device, and there is none \(.+\); pool, stitching, expandable, plain and system run on host memory`
	}
	for _, name := range []string{"cuda", "async", "managed"} {
		var out, errOut bytes.Buffer
		err := run([]string{"-mr", name, "no-such-trace.csv"}, &out, &errOut)
		require.Error(t, err)
		require.Equal(t, 1, exitStatus(err))
		require.Regexp(t, "^"+msg(name)+"$", err.Error())
		require.Empty(t, out.String(), "nothing replayed")

		out.Reset()
		errOut.Reset()
		err = run([]string{"-mr", "plain," + name + ",expandable", cupy}, &out, &errOut)
		require.NoError(t, err)
		require.Regexp(t, "^rmm-replay: left out: "+msg(name)+"\n", errOut.String())
		require.Contains(t, out.String(), "plain")
		require.Contains(t, out.String(), "expandable")
		require.NotContains(t, out.String(), name+" ")

		// One left of two: still the table, and with -json still a list.
		out.Reset()
		require.NoError(t, run([]string{"-mr", name + ",system", cupy}, &out, &errOut))
		require.Contains(t, out.String(), "rmm-replay: system  SystemMemoryResource")
		require.Contains(t, out.String(), "passes           1 on each resource\n")
		out.Reset()
		require.NoError(t, run([]string{"-json", "-mr", name + ",system", cupy}, &out, &errOut))
		var list []struct {
			Name string `json:"name"`
		}
		require.NoError(t, json.Unmarshal(out.Bytes(), &list), out.String())
		require.Len(t, list, 1)
		require.Equal(t, "system", list[0].Name)
	}
}

// Errors name the trace once and no type of this command's.
func TestReplayErrorsNameTraceOnce(t *testing.T) {
	dir := t.TempDir()
	raw, err := os.ReadFile(cupy)
	require.NoError(t, err)
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, data, 0o644))
		return p
	}
	for _, tc := range []struct {
		path, want string
	}{
		{filepath.Join(dir, "missing.csv.gz"), "no such file or directory"},
		{write("cut.csv.gz", raw[:len(raw)/2]), "unexpected EOF (the file is cut short)"},
		{write("corrupt.csv.gz", append([]byte{0x1f, 0x8b}, bytes.Repeat([]byte("garbage"), 20)...)), "gzip"},
		{write("notgzip.csv.gz", []byte("hello\n")), "header has no Thread column"},
		{write("badline.csv", []byte(rmm.LogHeader+"\n0,00:00:00.000000,allocate,0x100,-5,0\n")), ":2: column Size: negative size -5"},
	} {
		var out, errOut bytes.Buffer
		err := run([]string{"-simulate", "16GiB", tc.path}, &out, &errOut)
		require.Error(t, err, tc.path)
		require.Equal(t, 1, exitStatus(err), tc.path)
		msg := err.Error()
		require.Contains(t, msg, tc.want)
		require.Equal(t, 1, strings.Count(msg, tc.path), "%s: %s", tc.path, msg)
		for _, internal := range []string{"peakResource", "floorResource", "target", "main.", "*rmm.", "%!"} {
			require.NotContains(t, msg, internal, msg)
		}
		require.Empty(t, out.String(), "nothing replayed")
	}
	for _, args := range [][]string{{"-mr", "nosuch", cupy}, {"-plot", "x.gif", cupy}, {"-mr", "pool,stitching", cupy}} {
		var out, errOut bytes.Buffer
		err := run(args, &out, &errOut)
		require.ErrorIs(t, err, errUsage)
		for _, internal := range []string{"peakResource", "main.", "*rmm.", "%!"} {
			require.NotContains(t, err.Error(), internal)
		}
		require.True(t, strings.HasPrefix(err.Error(), "usage: -"), err.Error())
	}
}

// A flag that does not parse is written once, by the flag package with the usage; main does not
// write it again (errPrinted), but the exit status is still that of a bad command line.
func TestReplayBadFlagPrintedOnce(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run([]string{"-bogus", "x", cupy}, &out, &errOut)
	require.ErrorIs(t, err, errUsage)
	require.ErrorIs(t, err, errPrinted)
	require.Equal(t, 2, exitStatus(err))
	require.Equal(t, 1, strings.Count(errOut.String(), "flag provided but not defined: -bogus"), errOut.String())
	require.Contains(t, errOut.String(), "usage: rmm-replay [flags] TRACE.csv[.gz]")
	// A bad value for a known flag is reported the same way.
	errOut.Reset()
	err = run([]string{"-passes", "two", cupy}, &out, &errOut)
	require.ErrorIs(t, err, errPrinted)
	require.Contains(t, errOut.String(), `invalid value "two" for flag -passes`)
	// An error found after parsing is not marked: main writes it.
	err = run([]string{"-passes", "0", cupy}, &out, &errOut)
	require.ErrorIs(t, err, errUsage)
	require.NotErrorIs(t, err, errPrinted)
	require.Empty(t, out.String())
}

func TestShortBytes(t *testing.T) {
	require.Equal(t, "589.5 MiB", shortBytes(618135910))
	require.Equal(t, "1.471 GiB", shortBytes(1579564032))
	require.Equal(t, "736.0 MiB", shortBytes(771751936))
	require.Equal(t, "12.00 KiB", shortBytes(12*1024))
	require.Equal(t, "100 B", shortBytes(100))
	require.Equal(t, "0", shortBytes(0))
	require.Equal(t, "1.25 GiB", binaryBytes(1.25*(1<<30)))
	require.Equal(t, "3 MiB", binaryBytes(3<<20))
}

// -mr names each kind of pool: the first lines name them, in -mr's order, and -json's
// "resource" too; over host memory (no -simulate) as over simulated memory.
func TestReplayPoolKinds(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-simulate", "16GiB", "-mr", "stitching,expandable,plain", cupy}, &out, &errOut), errOut.String())
	lines := strings.Split(out.String(), "\n")
	require.Equal(t, "rmm-replay: stitching   stitching PoolMemoryResource over SimulatedMemoryResource (17179869184 bytes, address-only)", lines[0])
	require.Equal(t, "rmm-replay: expandable  expandable PoolMemoryResource over SimulatedMemoryResource (17179869184 bytes, address-only)", lines[1])
	require.Equal(t, "rmm-replay: plain       PoolMemoryResource over SimulatedMemoryResource (17179869184 bytes, address-only)", lines[2])
	require.Regexp(t, `\nstitching +0 +\S+ +\d+ +589\.5 MiB +616\.0 MiB +1\.045\n`, out.String())

	if rmm.CUDAAvailable() == nil {
		t.Skip("the rest is over host memory")
	}
	out.Reset()
	require.NoError(t, run([]string{"-json", "-mr", "pool", cupy}, &out, &errOut), errOut.String())
	var j replayJSON
	require.NoError(t, json.Unmarshal(out.Bytes(), &j), out.String())
	require.Equal(t, "pool", j.Name)
	require.True(t, strings.HasPrefix(j.Resource, "stitching PoolMemoryResource over SystemMemoryResource (host memory; "), j.Resource)
	// Not quite simulated memory's figure: over host memory each piece the pool maps holds an
	// open file, so its pieces may be larger.
	require.GreaterOrEqual(t, j.PeakReservedBytes, j.PeakLiveBytes)
}

// The library's errors reach the user in their one shape: the command's context ("-mr pool: "),
// then "rmm: Op: what went wrong: cause" with "rmm: " once, and no Go type names.
func TestLibraryErrorShape(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.csv")
	require.NoError(t, os.WriteFile(bad, []byte(rmm.LogHeader+"\n0,00:00:00.000000,allocate,0x100,-5,0\n"), 0o644))
	for _, tc := range []struct {
		args     []string
		sentinel error
		want     string
	}{
		{[]string{"-mr", "plain", "-initial", "1TiB", "-simulate", "1GiB", cupy}, rmm.ErrOutOfMemory,
			"-mr plain: rmm: NewPoolMemoryResource: taking the initial 1099511627776 bytes (1 TiB) from SimulatedMemoryResource: SimulatedMemoryResource.Allocate (capacity 1073741824, in use 0): failed to allocate 1099511627776 bytes (1 TiB): out of memory"},
		{[]string{"-simulate", "1GiB", bad}, rmm.ErrMalformedLog,
			"rmm: " + bad + ":2: column Size: negative size -5: malformed event log"},
		{[]string{"-device", "7", cupy}, rmm.ErrInvalidArgument,
			"usage: -device 7: rmm: SetCurrentDevice: device 7 does not exist ("},
	} {
		var out, errOut bytes.Buffer
		err := run(tc.args, &out, &errOut)
		require.ErrorIs(t, err, tc.sentinel, "%v", tc.args)
		msg := err.Error()
		require.True(t, strings.HasPrefix(msg, tc.want), "%v: %s", tc.args, msg)
		require.Equal(t, 1, strings.Count(msg, "rmm: "), msg)
		require.True(t, strings.HasSuffix(msg, strings.TrimPrefix(tc.sentinel.Error(), "rmm: ")), msg)
		for _, internal := range []string{"*rmm.", "main.", "%!"} {
			require.NotContains(t, msg, internal, msg)
		}
	}
}

// A trace that contradicts itself (a free of another size than its allocation's, a pointer
// allocated again while live, a free of a pointer never allocated) replays, exit 0, and the
// report and -json say how many of each there were and what the replay did with them.
func TestReplayOddTrace(t *testing.T) {
	path := filepath.Join(t.TempDir(), "odd.csv")
	require.NoError(t, os.WriteFile(path, []byte(rmm.LogHeader+"\n"+
		"1,00:00:00.000001,allocate,0x100,1000,0\n"+
		"1,00:00:00.000002,free,0x100,500,0\n"+
		"1,00:00:00.000003,allocate,0x200,2000,0\n"+
		"1,00:00:00.000004,allocate,0x200,3000,0\n"+
		"1,00:00:00.000005,free,0x200,3000,0\n"+
		"1,00:00:00.000006,free,0x900,64,0\n"), 0o644))
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-simulate", "1GiB", path}, &out, &errOut), errOut.String())
	s := out.String()
	require.Contains(t, s, "left allocated   1 allocations, 2000 bytes (freed after the replay)\n")
	require.Contains(t, s, "unmatched frees  1 (skipped)\n")
	require.Contains(t, s, "mismatched frees 1 (a size other than the allocation's: freed with the allocation's size)\n")
	require.Contains(t, s, "duplicate allocs 1 (a pointer allocated again while live: the earlier allocation left allocated, counted above)\n")

	out.Reset()
	require.NoError(t, run([]string{"-simulate", "1GiB", "-mr", "plain,expandable", path}, &out, &errOut), errOut.String())
	s = out.String()
	require.Contains(t, s, "mismatched frees 1 (")
	require.Contains(t, s, "duplicate allocs 1 (")

	out.Reset()
	require.NoError(t, run([]string{"-json", "-simulate", "1GiB", path}, &out, &errOut), errOut.String())
	var j map[string]any
	require.NoError(t, json.Unmarshal(out.Bytes(), &j), out.String())
	require.Equal(t, 1.0, j["mismatched_frees"])
	require.Equal(t, 1.0, j["duplicate_allocations"])
	require.Equal(t, 1.0, j["unmatched_frees"])
	require.Equal(t, 1.0, j["left_allocations"])

	// A trace without any: no such lines, and zeros in -json.
	out.Reset()
	require.NoError(t, run([]string{"-simulate", "16GiB", cupy}, &out, &errOut))
	require.NotContains(t, out.String(), "mismatched frees")
	require.NotContains(t, out.String(), "duplicate allocs")
}

// -json's "vmm" is the pool's PoolStats.VMM after the replay, the same as a pool of the same kind
// over the same simulated memory shows after the same passes in process (-serial: the calls in
// one order, so the same counts every run); "vmm_per_pass" adds up to it with what making the
// pool took. On the CuPy trace the stitching pool maps in its first pass only: the second finds
// every shape it needs mapped.
func TestReplayVMMCounts(t *testing.T) {
	events, err := rmm.ReadLogFile(cupy)
	require.NoError(t, err)
	for _, kind := range []rmm.PoolKind{rmm.StitchingPool, rmm.ExpandablePool} {
		var out, errOut bytes.Buffer
		require.NoError(t, run([]string{"-json", "-simulate", "16GiB", "-serial", "-passes", "3", "-mr", kind.String(), cupy}, &out, &errOut), errOut.String())
		var j replayJSON
		require.NoError(t, json.Unmarshal(out.Bytes(), &j), out.String())
		require.NotNil(t, j.VMM, kind)
		require.Len(t, j.VMMPerPass, 3, kind)

		sim, err := rmm.NewSimulatedMemoryResource(16 << 30)
		require.NoError(t, err)
		opts := kind.Options()
		pool, err := rmm.NewPoolMemoryResource(sim, &opts)
		require.NoError(t, err)
		made := pool.Stats().VMM
		for range 3 {
			_, err := rmm.Replay(events, pool, &rmm.ReplayOptions{Serial: true})
			require.NoError(t, err)
		}
		want := pool.Stats().VMM
		require.NoError(t, pool.Close())
		require.Equal(t, vmmJSON(want), *j.VMM, kind)

		sum := vmmJSON(made)
		for _, p := range j.VMMPerPass {
			sum.Creates += p.Creates
			sum.Maps += p.Maps
			sum.SetAccess += p.SetAccess
			sum.Unmaps += p.Unmaps
			sum.Releases += p.Releases
			sum.Reserves += p.Reserves
			sum.AddressFrees += p.AddressFrees
			sum.StitchedRanges += p.StitchedRanges
			sum.StitchedEvicted += p.StitchedEvicted
			sum.AddressReserved, sum.StitchedKept = p.AddressReserved, p.StitchedKept // levels
		}
		require.Equal(t, *j.VMM, sum, kind)

		first, later := j.VMMPerPass[0], j.VMMPerPass[1:]
		require.Positive(t, first.Creates, kind)
		require.Positive(t, first.Maps, kind)
		for _, p := range later {
			require.Zero(t, p.Maps, kind)
			require.Zero(t, p.Creates, kind)
			require.Equal(t, first.AddressReserved, p.AddressReserved, kind)
		}
		if kind == rmm.StitchingPool {
			require.Positive(t, first.StitchedRanges)
			require.Greater(t, first.Reserves, first.StitchedRanges-1, "a range reserved per stitched range")
		} else {
			require.Zero(t, j.VMM.StitchedRanges)
			require.Equal(t, 1, j.VMM.Reserves, "the pool's one range, reserved when it was made")
		}
	}
}

// The text report gives a line of driver calls per pass for an expandable pool, and the table a
// line per pass under each pool's name; librmm's pool and -json without a pool have none.
func TestReplayVMMText(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-simulate", "16GiB", "-serial", "-passes", "2", cupy}, &out, &errOut), errOut.String())
	// The stitched ranges' address space comes on top of the pool's own range (16 GiB).
	require.Contains(t, out.String(), "\n"+
		"driver calls     pass 1: 308 creates, 1038 maps, 20 set-access, 0 unmaps, 0 releases; 6 stitched (kept 6, evicted 0); 17.43 GiB address space\n"+
		"                 pass 2: 0 creates, 0 maps, 0 set-access, 0 unmaps, 0 releases; 0 stitched (kept 6, evicted 0); 17.43 GiB address space\n"+
		"left allocated   ")

	out.Reset()
	require.NoError(t, run([]string{"-simulate", "16GiB", "-mr", "expandable", cupy}, &out, &errOut), errOut.String())
	require.Contains(t, out.String(), "\ndriver calls     8 creates, 8 maps, 8 set-access, 0 unmaps, 0 releases; 16.00 GiB address space\n")

	out.Reset()
	require.NoError(t, run([]string{"-simulate", "16GiB", "-mr", "plain,stitching,expandable", "-passes", "2", cupy}, &out, &errOut), errOut.String())
	s := out.String()
	require.Regexp(t, `\n\ndriver calls     stitching   pass 1: [1-9]\d* creates, .*; [1-9]\d* stitched .*; 17\.43 GiB address space\n`+
		`                             pass 2: 0 creates, .*\n`+
		`                 expandable  pass 1: 8 creates, 8 maps, 8 set-access, 0 unmaps, 0 releases; 16\.00 GiB address space\n`+
		`                             pass 2: 0 creates, 0 maps, 0 set-access, 0 unmaps, 0 releases; 16\.00 GiB address space\n$`, s)
	require.NotContains(t, s, "plain   pass")

	out.Reset()
	require.NoError(t, run([]string{"-simulate", "16GiB", "-mr", "plain", cupy}, &out, &errOut), errOut.String())
	require.NotContains(t, out.String(), "driver calls")
	out.Reset()
	require.NoError(t, run([]string{"-json", "-simulate", "16GiB", "-mr", "plain", cupy}, &out, &errOut), errOut.String())
	require.NotContains(t, out.String(), `"vmm`)
	out.Reset()
	require.NoError(t, run([]string{"-json", "-mr", "system", cupy}, &out, &errOut), errOut.String())
	require.NotContains(t, out.String(), `"vmm`)
}

// -window: the windows cover every event of every pass once, in order, each of -window events
// but the last; their driver calls add up to the passes', their levels at the last window's end
// are the run's, and their peaks are the run's peaks. Every event is timed but the first of each
// pass. Several resources get windows each.
func TestReplayWindows(t *testing.T) {
	const size, events, passes = 30000, 110156, 2
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-json", "-simulate", "16GiB", "-serial", "-passes", "2", "-window", fmt.Sprint(size), "-mr", "stitching,plain,expandable", cupy}, &out, &errOut), errOut.String())
	var list []replayJSON
	require.NoError(t, json.Unmarshal(out.Bytes(), &list), out.String())
	require.Len(t, list, 3)
	for _, j := range list {
		require.Len(t, j.Windows, (events*passes+size-1)/size, j.Name)
		total, timed := 0, 0
		var peakLive, peakReserved int64
		for i, w := range j.Windows {
			require.Equal(t, total, w.FirstEvent, "%s window %d", j.Name, i)
			if i < len(j.Windows)-1 {
				require.Equal(t, size, w.Events, "%s window %d", j.Name, i)
			}
			require.Equal(t, w.FirstEvent/events+1, w.FirstPass, "%s window %d", j.Name, i)
			require.Equal(t, (w.FirstEvent+w.Events-1)/events+1, w.LastPass, "%s window %d", j.Name, i)
			total += w.Events
			timed += w.TimedEvents
			require.LessOrEqual(t, w.LiveBytes, w.PeakLiveBytes)
			require.LessOrEqual(t, w.ReservedBytes, w.PeakReservedBytes)
			require.Positive(t, w.NsPerEvent)
			peakLive = max(peakLive, w.PeakLiveBytes)
			peakReserved = max(peakReserved, w.PeakReservedBytes)
		}
		require.Equal(t, events*passes, total, j.Name)
		require.Equal(t, passes*(events-1), timed, "%s: all but the first event of each pass", j.Name)
		require.Equal(t, j.PeakLiveBytes, peakLive, j.Name)
		require.Equal(t, j.PeakReservedBytes, peakReserved, j.Name)
		require.Zero(t, j.Windows[len(j.Windows)-1].LiveBytes, "%s: the trace frees all it allocates", j.Name)
		if j.Name == "plain" {
			for _, w := range j.Windows {
				require.Nil(t, w.VMM, j.Name)
			}
			continue
		}
		// The windows' calls add up to the passes' (both leave out the pool's making), and the
		// last window ends where the last pass does.
		var sum, perPass vmmJSON
		add := func(to *vmmJSON, v vmmJSON) {
			to.Creates += v.Creates
			to.Maps += v.Maps
			to.SetAccess += v.SetAccess
			to.Unmaps += v.Unmaps
			to.Releases += v.Releases
			to.Reserves += v.Reserves
			to.AddressFrees += v.AddressFrees
			to.StitchedRanges += v.StitchedRanges
			to.StitchedEvicted += v.StitchedEvicted
			to.AddressReserved, to.StitchedKept = v.AddressReserved, v.StitchedKept
		}
		for _, w := range j.Windows {
			require.NotNil(t, w.VMM)
			add(&sum, *w.VMM)
		}
		for _, p := range j.VMMPerPass {
			add(&perPass, p)
		}
		require.Equal(t, perPass, sum)
		require.Equal(t, j.VMM.AddressReserved, sum.AddressReserved)
		require.Equal(t, j.VMM.StitchedKept, sum.StitchedKept)
		require.Equal(t, j.VMM.Maps, sum.Maps, "making the pool maps nothing (-initial 0)")
		require.Positive(t, j.Windows[0].VMM.Maps, "%s: the first window maps", j.Name)
		require.Zero(t, j.Windows[len(j.Windows)-1].VMM.Maps, "%s: the second pass maps nothing", j.Name)
	}

	// The text report: a table after it, a row per window.
	out.Reset()
	require.NoError(t, run([]string{"-simulate", "16GiB", "-passes", "2", "-window", "50000", cupy}, &out, &errOut), errOut.String())
	s := out.String()
	require.Contains(t, s, "\n\nwindows of 50000 events: ")
	require.Regexp(t, `\n +window +pass +events +ns/event +live +peak live +reserved +peak reserved +reserved/live +creates +maps +unmaps +releases +stitched +evicted +kept +address space\n`, s)
	require.Regexp(t, `\n +1 +1 +50000 +\d+ +36\.03 MiB +589\.5 MiB +616\.0 MiB +616\.0 MiB +1\.045 +[1-9]\d* +[1-9]\d* +0 +0 +6 +0 +6 +17\.43 GiB\n`, s)
	require.Regexp(t, `\n +3 +1-2 +50000 +\d+ +`, s)
	require.Regexp(t, `\n +5 +2 +20312 +\d+ +0 +427\.9 MiB +616\.0 MiB +616\.0 MiB +1\.439 +0 +0 +0 +0 +0 +0 +6 +17\.43 GiB\n$`, s)

	// Several resources over host memory, -serial: a table each, after the resources' table;
	// what system holds is what is live. (Where the plain pool's growth lands depends on the
	// addresses the host hands out: its figures are not checked here.)
	out.Reset()
	require.NoError(t, run([]string{"-serial", "-window", "60000", "-mr", "plain,system", cupy}, &out, &errOut), errOut.String())
	s = out.String()
	plain, system := strings.Index(s, "\n\nwindows of 60000 events on plain: "), strings.Index(s, "\n\nwindows of 60000 events on system: ")
	require.Positive(t, plain, s)
	require.Greater(t, system, plain, s)
	require.Greater(t, plain, strings.Index(s, "\nresource "), s)
	require.Regexp(t, `\n +window +pass +events +ns/event +live +peak live +reserved +peak reserved +reserved/live\n +1 +1 +60000 +\d+ +(\S+ \S+) +589\.5 MiB +\S+ \S+ +\S+ \S+ +\d\.\d{3}\n +2 +1 +50156 +\d+ +0 +`, s[plain:system])
	require.Regexp(t, `\n +1 +1 +60000 +\d+ +(\S+ \S+) +589\.5 MiB +(\S+ \S+) +589\.5 MiB +1\.000\n +2 +1 +50156 +\d+ +0 +\S+ \S+ +0 +\S+ \S+ +1\.000\n$`, s[system:])
}

// Windows of one event: the first event of each pass is not timed (no ns/event), every other is.
func TestReplayWindowOfOne(t *testing.T) {
	path := filepath.Join(t.TempDir(), "small.csv")
	require.NoError(t, os.WriteFile(path, []byte(rmm.LogHeader+"\n"+
		"1,00:00:00.000001,allocate,0x100,1000,0\n"+
		"1,00:00:00.000002,allocate,0x200,3000,0\n"+
		"1,00:00:00.000003,free,0x100,1000,0\n"+
		"1,00:00:00.000004,free,0x200,3000,0\n"), 0o644))
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-json", "-simulate", "1GiB", "-mr", "plain", "-passes", "2", "-window", "1", path}, &out, &errOut), errOut.String())
	var j replayJSON
	require.NoError(t, json.Unmarshal(out.Bytes(), &j), out.String())
	require.Len(t, j.Windows, 8)
	live := []int64{1000, 4000, 3000, 0}
	for i, w := range j.Windows {
		require.Equal(t, 1, w.Events)
		require.Equal(t, live[i%4], w.LiveBytes, "window %d", i)
		require.Equal(t, live[i%4], w.PeakLiveBytes, "window %d", i)
		if i%4 == 0 {
			require.Zero(t, w.TimedEvents, "window %d", i)
			require.Zero(t, w.NsPerEvent, "window %d", i)
		} else {
			require.Equal(t, 1, w.TimedEvents, "window %d", i)
		}
	}
	out.Reset()
	require.NoError(t, run([]string{"-simulate", "1GiB", "-mr", "plain", "-passes", "2", "-window", "1", path}, &out, &errOut), errOut.String())
	require.Regexp(t, `\n +1 +1 +1 +- +1000 B +1000 B +`, out.String())
	require.Regexp(t, `\n +6 +2 +1 +\d+ +3.906 KiB +3.906 KiB +`, out.String())
}

func TestReplayWindowBad(t *testing.T) {
	for _, n := range []string{"-1", "-3"} {
		var out, errOut bytes.Buffer
		err := run([]string{"-window", n, cupy}, &out, &errOut)
		require.ErrorContains(t, err, "-window "+n+": a window holds at least 1 event")
		require.Equal(t, 2, exitStatus(err))
		require.Empty(t, out.String())
	}
	var out, errOut bytes.Buffer
	err := run([]string{"-window", "many", cupy}, &out, &errOut)
	require.Equal(t, 2, exitStatus(err))
	require.Contains(t, errOut.String(), `invalid value "many" for flag -window`)
	// -window 0 is the default spelled out: no windows.
	out.Reset()
	require.NoError(t, run([]string{"-simulate", "64GiB", "-window", "0", cupy}, &out, &errOut), errOut.String())
	require.NotContains(t, out.String(), "windows of")
}
