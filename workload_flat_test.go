package rmm_test

import (
	"flag"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/internal/workload"
	"github.com/stretchr/testify/require"
)

// flatWindow is what TestServingWorkloadFlat records at the end of each window of events.
type flatWindow struct {
	end      int   // events replayed
	peakLive int64 // the most bytes the log held live during the window
	live     int64 // bytes live at its end
	pool     rmm.PoolStats
	wall     time.Duration // replaying the window's events (Stats and the sampling left out)
	timed    int           // the events wall covers
}

// replayWindows replays log, serially, through a stitching pool over 256 GiB of simulated
// memory, and returns what it recorded at the end of every window of events (and of the log).
// The caller closes the pool.
func replayWindows(t *testing.T, log []rmm.LogEvent, window int) ([]flatWindow, rmm.ReplayResult, *rmm.PoolMemoryResource) {
	const capacity = 256 << 30
	sim, err := rmm.NewSimulatedMemoryResource(capacity)
	require.NoError(t, err)
	opts := rmm.StitchingPool.Options()
	opts.MaximumPoolSize = capacity
	pool, err := rmm.NewPoolMemoryResource(sim, &opts)
	require.NoError(t, err)
	var wins []flatWindow
	var peak int64
	var mark time.Time
	timedFrom := 0
	res, err := rmm.Replay(log, pool, &rmm.ReplayOptions{Serial: true, AfterEvent: func(i int, live int64) {
		peak = max(peak, live)
		if i == 0 {
			// The clock starts after the first event: Replay's pass over the log before it is
			// not the pool's cost.
			mark, timedFrom = time.Now(), 1
		}
		if (i+1)%window == 0 || i == len(log)-1 {
			wall := time.Since(mark)
			wins = append(wins, flatWindow{end: i + 1, peakLive: peak, live: live, pool: pool.Stats(), wall: wall, timed: i + 1 - timedFrom})
			peak = live
			mark, timedFrom = time.Now(), i+1
		}
	}})
	require.NoError(t, err)
	return wins, res, pool
}

// TestServingWorkloadFlat replays a generated language-model service (internal/workload: weights,
// then requests of shapes that never quite repeat, with growing key/value caches, a few in
// flight at once) through the default pool, a stitching pool over simulated memory, and checks
// that its footprint stays flat once warmed up: a pool that ratchets (maps more, reserves more
// address space or keeps more stitched ranges as new shapes keep coming) would run a long-lived
// service out of memory however little it holds live.
//
// The full windows are split in thirds: the first is the warm-up, the last is checked against
// what came before it. The pool may grow wherever the log itself holds more live than ever
// before (a new demand, not a ratchet), so the rules look at the windows of the last third that
// hold no more live than the log held at some earlier point (the quiet ones):
//   - No allocation fails, and the pool's peak is at most 5% above the most the log held live.
//   - At the end of each quiet window of the last third, the pool's size, the address space it
//     reserves and the stitched ranges it keeps mapped are at most their maximum at the ends of
//     the windows before it: shapes of a kind already met must reuse what is mapped.
//   - The quiet windows of the last third make, on average, at most a quarter of the driver
//     calls (creates, maps, unmaps, releases) per window of the warm-up: stitching's first pass
//     over a shape costs calls, later passes over a like one should mostly reuse what is mapped.
//
// The table of windows is logged. Where a rule fails the test is skipped with what failed: the
// figures are the finding.
func TestServingWorkloadFlat(t *testing.T) {
	const (
		events = 350_000
		window = 25_000
	)
	if testing.Short() {
		t.Skip("replays 350,000 generated events")
	}
	log, err := workload.ServingEvents(workload.ServingConfig{Seed: 1, Events: events})
	require.NoError(t, err)
	wins, res, pool := replayWindows(t, log, window)
	defer func() { require.NoError(t, pool.Close()) }()
	t.Log(flatTable(wins))
	st := pool.Stats()
	t.Logf("%d events, %d allocations; peak live %s, peak pool %s (%.3f×)", res.Events, res.Allocations,
		gib(res.PeakLiveBytes), gib(int64(st.PeakPoolSize)), float64(st.PeakPoolSize)/float64(res.PeakLiveBytes))

	var problems []string
	if res.Failures != 0 {
		problems = append(problems, fmt.Sprintf("%d allocations failed", res.Failures))
	}
	if float64(st.PeakPoolSize) > 1.05*float64(res.PeakLiveBytes) {
		problems = append(problems, fmt.Sprintf("peak pool %d is %.3f× the peak live %d (at most 1.05×)",
			st.PeakPoolSize, float64(st.PeakPoolSize)/float64(res.PeakLiveBytes), res.PeakLiveBytes))
	}
	full := wins[:len(wins)-1] // the last may be short: the end of the log frees everything
	third := len(full) / 3
	warm := full[:third]
	var before flatWindow // the maxima over the windows so far
	var quiet, quietCalls int
	for i, w := range full {
		if i >= 2*third {
			if w.peakLive > before.peakLive {
				t.Logf("window ending at event %d holds %s live, more than ever before: the pool may grow", w.end, gib(w.peakLive))
			} else {
				quiet++
				for _, c := range []struct {
					name string
					now  int
					max  int
				}{
					{"pool size", w.pool.PoolSize, before.pool.PoolSize},
					{"address reserved", w.pool.VMM.AddressReserved, before.pool.VMM.AddressReserved},
					{"stitched kept", w.pool.VMM.StitchedKept, before.pool.VMM.StitchedKept},
				} {
					if c.now > c.max {
						problems = append(problems, fmt.Sprintf("%s %d at event %d, above the most before, %d", c.name, c.now, w.end, c.max))
					}
				}
				quietCalls += driverCalls(w.pool.VMM) - driverCalls(full[i-1].pool.VMM)
			}
		}
		before.peakLive = max(before.peakLive, w.peakLive)
		before.pool.PoolSize = max(before.pool.PoolSize, w.pool.PoolSize)
		before.pool.VMM.AddressReserved = max(before.pool.VMM.AddressReserved, w.pool.VMM.AddressReserved)
		before.pool.VMM.StitchedKept = max(before.pool.VMM.StitchedKept, w.pool.VMM.StitchedKept)
	}
	warmCalls := float64(driverCalls(warm[len(warm)-1].pool.VMM)) / float64(len(warm))
	if quiet > 0 {
		perWindow := float64(quietCalls) / float64(quiet)
		t.Logf("driver calls per window: warm-up %.1f, quiet windows of the last third (%d) %.1f", warmCalls, quiet, perWindow)
		if perWindow > warmCalls/4 {
			problems = append(problems, fmt.Sprintf("driver calls per quiet window of the last third %.1f, above a quarter of the warm-up's %.1f", perWindow, warmCalls))
		}
	}
	if len(problems) > 0 {
		t.Skip("the stitching pool is not flat on the serving workload:\n" + strings.Join(problems, "\n"))
	}
}

// driverCalls sums the calls that create, map, unmap and release memory.
func driverCalls(v rmm.VMMStats) int { return v.Creates + v.Maps + v.Unmaps + v.Releases }

// flatTable formats the windows: per window the events, the most live and the live at its end,
// the pool's size and peak, and the driver calls and stitched ranges made in the window, with
// the address space reserved and the stitched ranges kept at its end.
func flatTable(wins []flatWindow) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\n%8s %8s %10s %10s %10s %10s %6s %6s %6s %6s %6s %6s %6s %10s %7s %8s\n", "events", "ns/event", "peak live", "live", "pool", "peak pool",
		"create", "map", "unmap", "releas", "stitch", "evict", "kept", "addr res", "pool/pk", "free blk")
	var prev rmm.VMMStats
	for _, w := range wins {
		v := w.pool.VMM
		fmt.Fprintf(&b, "%8d %8.0f %10s %10s %10s %10s %6d %6d %6d %6d %6d %6d %6d %10s %7.3f %8d\n", w.end, float64(w.wall.Nanoseconds())/float64(max(w.timed, 1)), gib(w.peakLive), gib(w.live),
			gib(int64(w.pool.PoolSize)), gib(int64(w.pool.PeakPoolSize)), v.Creates-prev.Creates, v.Maps-prev.Maps, v.Unmaps-prev.Unmaps,
			v.Releases-prev.Releases, v.StitchedRanges-prev.StitchedRanges, v.StitchedEvicted-prev.StitchedEvicted, v.StitchedKept,
			gib(int64(v.AddressReserved)), float64(w.pool.PoolSize)/float64(max(w.peakLive, 1)), w.pool.FreeBlocks)
		prev = v
	}
	return b.String()
}

func gib(n int64) string { return fmt.Sprintf("%.2fG", float64(n)/(1<<30)) }

var servingLong = flag.Int("rmm.servingevents", 0, "replay this many events of the generated serving workload through the default pool and log its footprint and driver calls per window of 100,000 events (a measurement, not a check; skipped without it)")

var servingSeed = flag.Int64("rmm.servingseed", 1, "with -rmm.servingevents: the workload's seed")

// TestServingWorkloadLong is TestServingWorkloadFlat's measurement at full length:
//
//	go test -run TestServingWorkloadLong -rmm.servingevents 2000000 -v .
func TestServingWorkloadLong(t *testing.T) {
	if *servingLong == 0 {
		t.Skip("a measurement: give -rmm.servingevents N")
	}
	log, err := workload.ServingEvents(workload.ServingConfig{Seed: *servingSeed, Events: *servingLong})
	require.NoError(t, err)
	wins, res, pool := replayWindows(t, log, 100_000)
	defer func() { require.NoError(t, pool.Close()) }()
	t.Log(flatTable(wins))
	st := pool.Stats()
	t.Logf("%d events, %d allocations, %d failed, %.0f ns/event; peak live %s, peak pool %s (%.3f×)", res.Events, res.Allocations, res.Failures,
		res.NsPerEvent(), gib(res.PeakLiveBytes), gib(int64(st.PeakPoolSize)), float64(st.PeakPoolSize)/float64(res.PeakLiveBytes))
}
