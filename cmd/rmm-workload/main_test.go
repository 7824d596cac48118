package main

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gormm/rmm"
	"github.com/stretchr/testify/require"
)

// generate runs the command with args and -o a file of that name in a temporary directory, and
// reads the log back.
func generate(t *testing.T, name string, args ...string) []rmm.LogEvent {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	var out, errOut bytes.Buffer
	require.NoError(t, run(append(args, "-o", path), &out, &errOut))
	require.Empty(t, errOut.String())
	require.True(t, strings.HasPrefix(out.String(), "rmm-workload: "+path+": "), out.String())
	events, err := rmm.ReadLogFile(path)
	require.NoError(t, err)
	return events
}

func TestWrite(t *testing.T) {
	small := []string{"-events", "50000", "-layers", "4", "-hidden", "1024"}
	plain := generate(t, "serving.csv", append(small, "-seed", "3")...)
	zipped := generate(t, "serving.csv.gz", append(small, "-seed", "3")...)
	require.GreaterOrEqual(t, len(plain), 50000)
	for i := range plain {
		plain[i].Line, zipped[i].Line = 0, 0
	}
	require.Equal(t, plain, zipped, "the same seed gives the same log, gzipped or not")
	other := generate(t, "other.csv.gz", append(small, "-seed", "4")...)
	same := len(other) == len(plain)
	for i := 0; same && i < len(plain); i++ {
		same = plain[i].Size == other[i].Size && plain[i].Action == other[i].Action
	}
	require.False(t, same, "another seed gives another log")

	// Every allocation is freed once, with its size, and the replay sees them balance.
	live := map[rmm.DevicePtr]int{}
	allocs := 0
	for _, e := range plain {
		switch e.Action {
		case rmm.ActionAllocate:
			allocs++
			live[e.Pointer] = e.Size
		case rmm.ActionFree:
			size, ok := live[e.Pointer]
			require.True(t, ok)
			require.Equal(t, size, e.Size)
			delete(live, e.Pointer)
		}
	}
	require.Empty(t, live)
	require.Equal(t, len(plain), 2*allocs)
	sim, err := rmm.NewSimulatedMemoryResource(1 << 40)
	require.NoError(t, err)
	res, err := rmm.Replay(plain, sim, &rmm.ReplayOptions{Serial: true})
	require.NoError(t, err)
	require.Zero(t, res.UnmatchedFrees)
	require.Zero(t, res.LeftAllocations)
	require.Equal(t, res.Allocations, res.Frees)
}

func TestWriteGzip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "w.csv.gz")
	var out, errOut bytes.Buffer
	require.NoError(t, run([]string{"-events", "1000", "-layers", "2", "-hidden", "256", "-o", path}, &out, &errOut))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, []byte{0x1f, 0x8b}, b[:2], "gzip")
}

func TestSideStream(t *testing.T) {
	events := generate(t, "side.csv", "-events", "30000", "-layers", "2", "-hidden", "512", "-sidestream", "1")
	for _, e := range events[100:] { // after the weights, all on the second stream
		if e.Stream != 0 && e.Stream != 0x1 {
			t.Fatalf("stream %#x", e.Stream)
		}
	}
	require.Equal(t, uintptr(0x1), events[len(events)/2].Stream)
}

func TestHelp(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run([]string{"-h"}, &out, &errOut)
	require.ErrorIs(t, err, flag.ErrHelp)
	require.Zero(t, exitStatus(err))
	require.Contains(t, errOut.String(), "usage: rmm-workload [flags] -o FILE.csv[.gz]")
	require.Contains(t, errOut.String(), "-kvblock")
}

func TestFlagErrors(t *testing.T) {
	dir := t.TempDir()
	o := filepath.Join(dir, "x.csv")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "need -o FILE"},
		{[]string{"-o", o, "extra"}, "unexpected arguments"},
		{[]string{"-bogus", "-o", o}, "flag provided but not defined: -bogus"},
		{[]string{"-events", "0", "-o", o}, "-events 0: must be at least 1"},
		{[]string{"-layers", "-1", "-o", o}, "-layers -1"},
		{[]string{"-hidden", "100", "-o", o}, "Hidden 100 is not a multiple of the head size 128"},
		{[]string{"-sidestream", "2", "-o", o}, "SideStream 2"},
		{[]string{"-oneoffs", "1.5", "-o", o}, "-oneoffs 1.5"},
		{[]string{"-seed", "x", "-o", o}, `invalid value "x" for flag -seed`},
	} {
		var out, errOut bytes.Buffer
		err := run(tc.args, &out, &errOut)
		require.Error(t, err, "%v", tc.args)
		require.Contains(t, err.Error()+errOut.String(), tc.want, "%v", tc.args)
		require.Equal(t, 2, exitStatus(err), "%v: %v", tc.args, err)
		require.Empty(t, out.String())
		require.NoFileExists(t, o, "%v: nothing written", tc.args)
	}
}

func TestUnwritable(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run([]string{"-events", "1000", "-o", filepath.Join(t.TempDir(), "no", "such", "dir.csv")}, &out, &errOut)
	require.Error(t, err)
	require.Equal(t, 1, exitStatus(err))
}
