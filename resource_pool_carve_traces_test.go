package rmm

import (
	"flag"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var carveDevice = flag.Bool("rmm.carvedevice", false, "with -rmm.carvetraces: replay over the device's virtual memory (GPU 0) instead of an address-only one, and log the median wall time per event of the passes")

var carveChurns = flag.String("rmm.carvechurns", "", "with -rmm.carvetraces: comma-separated PoolOptions.carveChurn values to replay with besides the default (-1: no limit)")

var carveTraces = flag.Int("rmm.carvetraces", 0, "with a page size in bytes: replay every trace in testdata/traces on an address-only expandable pool that carves with that page size, and on one that does not, at one pass and three (see -rmm.carvepasses), and log the footprints and driver calls (a measurement, not a check; skipped without it)")

var carvePassesFlag = flag.String("rmm.carvepasses", "1,3", "with -rmm.carvetraces: the pass counts to replay")

// TestCarveTraces is the measurement behind carve's figures:
//
//	go test -run TestCarveTraces -rmm.carvetraces 8388608 [-rmm.carvechurns -1,1] [-rmm.carvepasses 1,3,10] -v
//
// and on a GPU, with -rmm.carvedevice, over the device's memory.
func TestCarveTraces(t *testing.T) {
	if *carveTraces == 0 {
		t.Skip("a measurement: give -rmm.carvetraces PAGE")
	}
	var carvePasses []int
	for _, x := range strings.Split(*carvePassesFlag, ",") {
		v, err := strconv.Atoi(x)
		require.NoError(t, err)
		carvePasses = append(carvePasses, v)
	}
	maximum, newVMM := traceReplayVMM(t, *carveDevice)
	files, err := filepath.Glob(filepath.Join("testdata", "traces", "*.csv.gz"))
	require.NoError(t, err)
	for _, f := range files {
		events, err := ReadLogFile(f)
		require.NoError(t, err)
		line := strings.TrimSuffix(filepath.Base(f), ".csv.gz")
		type cfg struct {
			page  int
			churn float64
		}
		cfgs := []cfg{{0, 0}, {*carveTraces, 0}}
		if *carveChurns != "" {
			for _, x := range strings.Split(*carveChurns, ",") {
				v, err := strconv.ParseFloat(x, 64)
				require.NoError(t, err)
				cfgs = append(cfgs, cfg{*carveTraces, v})
			}
		}
		for _, c := range cfgs {
			page := c.page
			for _, passes := range carvePasses {
				vm := newCountingVMM(newVMM())
				p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: maximum, carvePage: page, carveChurn: c.churn})
				peakLive := 0
				var c1, c2 vmmCounts
				var walls []time.Duration
				for i := range passes {
					start := time.Now()
					r, err := Replay(events, p, nil)
					walls = append(walls, time.Since(start))
					require.NoError(t, err)
					require.Zero(t, r.Failures)
					peakLive = max(peakLive, int(r.PeakLiveBytes))
					c1, c2 = c2, vm.counts()
					if i == 0 {
						c1 = vmmCounts{}
					}
				}
				require.NoError(t, p.CheckInvariants())
				last := vmmCounts{creates: c2.creates - c1.creates, maps: c2.maps - c1.maps, unmaps: c2.unmaps - c1.unmaps}
				slices.Sort(walls)
				line += fmt.Sprintf(" | page %d churn %g p%d %.3f (last pass: %d creates, %d maps, %d unmaps; median %d ns/event)", page>>20, c.churn, passes,
					float64(p.Stats().PeakPoolSize)/float64(peakLive), last.creates, last.maps, last.unmaps,
					walls[len(walls)/2].Nanoseconds()/int64(len(events)))
				require.NoError(t, p.Close())
			}
		}
		t.Log(line)
	}
}

// traceReplayVMM returns the maximum pool size and a maker of VMMs for the trace measurements:
// an address-only VMM under 1 TiB, or with device the device's virtual memory under 15/16 of its
// free memory (GPU 0; skipped without one).
func traceReplayVMM(t *testing.T, device bool) (int, func() vmm) {
	if !device {
		return 1 << 40, func() vmm { return newSimVMM(hostVMMGranularity, 0) }
	}
	requireGPU(t)
	free, _, err := Device(0).MemoryInfo()
	require.NoError(t, err)
	return free / 16 * 15 / hostVMMGranularity * hostVMMGranularity, func() vmm {
		vm, err := newDeviceVMM(0)
		require.NoError(t, err)
		return vm
	}
}
