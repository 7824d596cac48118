package rmm

import (
	"flag"
	"fmt"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

var firstPass = flag.Bool("rmm.firstpass", false, "replay every bundled trace three times on a stitching pool over address-only memory and print the driver calls of the first pass, their modelled cost per event and the footprints (a measurement, not a check; skipped without it)")

var firstPassMatch = flag.String("rmm.firstpassmatch", "", "with -rmm.firstpass: only the traces whose name contains this")

var firstPassTune = flag.String("rmm.firstpasstune", "", "with -rmm.firstpass: poolTuning fields to set, as name=value,... (names: see firstPassKnobs)")

// firstPassKnobs are the poolTuning fields -rmm.firstpasstune can set (a zero keeps the default).
func firstPassKnobs(t *poolTuning) map[string]*int {
	return map[string]*int{
		"piece":   &t.stitchPiece,
		"min":     &t.stitchMin,
		"keep":    &t.stitchKeep,
		"frac":    &t.stitchFrac,
		"growth":  &t.minGrowth,
		"growdiv": &t.growthDivisor,
		"reqdiv":  &t.stitchReqDiv,
		"cap":     &t.stitchPieceCap,
	}
}

// Modelled cost of each driver call, in nanoseconds, per call (not per byte): a create, a map
// with its share of the access call, an unmap, a release and a reservation.
const (
	modelCreateNs  = 16000
	modelMapNs     = 33000
	modelUnmapNs   = 20000
	modelReleaseNs = 14000
	modelReserveNs = 5000
)

func modelledNs(c vmmCounts) int {
	return modelCreateNs*c.creates + modelMapNs*c.maps + modelUnmapNs*c.unmaps + modelReleaseNs*c.releases + modelReserveNs*c.reserves
}

// TestFirstPass prints, per bundled trace, what a stitching pool (PoolOptions.Stitch, with
// -rmm.firstpasstune's changes) does over address-only memory in three serial passes on one pool:
// the events, the creates, maps, unmaps, releases and reservations of the first pass, their
// modelled cost per event (modelledNs), the footprint (peak pool size / peak live bytes) after
// the first pass and over the three, and the maps of passes 2 and 3. Traces are numbered in
// sorted order; the totals are given for the odd ones, the even ones and all.
//
//	go test -run TestFirstPass -rmm.firstpass -v .
func TestFirstPass(t *testing.T) {
	if !*firstPass {
		t.Skip("a measurement: give -rmm.firstpass")
	}
	var tune poolTuning
	if *firstPassTune != "" {
		knobs := firstPassKnobs(&tune)
		for _, kv := range strings.Split(*firstPassTune, ",") {
			k, v, ok := strings.Cut(kv, "=")
			require.True(t, ok, "%q: want name=value", kv)
			x, err := strconv.Atoi(v)
			require.NoError(t, err)
			f := knobs[k]
			require.NotNil(t, f, "unknown knob %q", k)
			*f = x
		}
	}
	files, err := filepath.Glob(filepath.Join("testdata", "traces", "*.csv.gz"))
	require.NoError(t, err)
	type row struct {
		name          string
		events        int
		c             vmmCounts
		later         int // maps in passes 2 and 3
		fp1, fp3      float64
		err           error
		odd, included bool
	}
	rows := make([]row, len(files))
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for i, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".csv.gz")
		rows[i] = row{name: name, odd: i%2 == 0, included: strings.Contains(name, *firstPassMatch)}
		if !rows[i].included {
			continue
		}
		wg.Add(1)
		go func(r *row, f string) {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			r.err = func() error {
				events, err := ReadLogFile(f)
				if err != nil {
					return err
				}
				r.events = len(events)
				vm := newCountingVMM(newSimVMM(hostVMMGranularity, 0))
				p, err := newExpandablePool(NewSystemMemoryResource(), vm, PoolOptions{Expandable: true, MaximumPoolSize: 1 << 40, Stitch: true}, tune)
				if err != nil {
					return err
				}
				defer p.Close()
				peakLive := 0
				for pass := 1; pass <= 3; pass++ {
					res, err := Replay(events, p, &ReplayOptions{Serial: true})
					if err != nil {
						return err
					}
					if res.Failures > 0 {
						return fmt.Errorf("pass %d: %d failures", pass, res.Failures)
					}
					peakLive = max(peakLive, int(res.PeakLiveBytes))
					fp := float64(p.Stats().PeakPoolSize) / float64(peakLive)
					if pass == 1 {
						r.c, r.fp1 = vm.counts(), fp
					}
					r.fp3 = fp
				}
				r.later = vm.counts().maps - r.c.maps
				return p.CheckInvariants()
			}()
		}(&rows[i], f)
	}
	wg.Wait()
	var out strings.Builder
	fmt.Fprintf(&out, "%-3s %-42s %7s %6s %6s %6s %6s %5s %8s %6s %6s %6s\n", "#", "trace", "events", "create", "maps", "unmaps", "releas", "resv", "ns/event", "fp1", "fp3", "maps23")
	type total struct {
		events, ns, over, later int
		worst                   float64
	}
	var odd, even total
	worst, worstName := 0.0, ""
	for i, r := range rows {
		if !r.included {
			continue
		}
		require.NoError(t, r.err, r.name)
		ns := modelledNs(r.c)
		tt := &even
		if r.odd {
			tt = &odd
		}
		tt.events += r.events
		tt.ns += ns
		if ns > 2000*r.events {
			tt.over++
		}
		tt.later += r.later
		tt.worst = max(tt.worst, r.fp1, r.fp3)
		if max(r.fp1, r.fp3) > worst {
			worst, worstName = max(r.fp1, r.fp3), r.name
		}
		fmt.Fprintf(&out, "%-3d %-42s %7d %6d %6d %6d %6d %5d %8d %6.3f %6.3f %6d\n", i+1, r.name, r.events, r.c.creates, r.c.maps, r.c.unmaps, r.c.releases, r.c.reserves, ns/r.events, r.fp1, r.fp3, r.later)
	}
	for _, x := range []struct {
		name string
		t    total
	}{{"odd", odd}, {"even", even}, {"all", total{odd.events + even.events, odd.ns + even.ns, odd.over + even.over, odd.later + even.later, max(odd.worst, even.worst)}}} {
		if x.t.events > 0 {
			fmt.Fprintf(&out, "%-5s %d ns/event over %d events; %d traces above 2 µs/event; worst footprint %.3f; %d maps in passes 2-3\n", x.name, x.t.ns/x.t.events, x.t.events, x.t.over, x.t.worst, x.t.later)
		}
	}
	fmt.Fprintf(&out, "worst footprint %.3f (%s)\n", worst, worstName)
	t.Log("\n" + out.String())
}
