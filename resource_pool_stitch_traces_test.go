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

var stitchTraces = flag.String("rmm.stitchtraces", "", "comma-separated stitch piece sizes in bytes: replay every trace in testdata/traces (or those matching -rmm.stitchmatch) on an address-only expandable pool without stitching and with each piece size, with and without growing the rest, and log the footprints at passes 1, 3 and 10 with the driver calls of passes 1, 2, 3 and 10 (a measurement, not a check; skipped without it)")

var stitchMatch = flag.String("rmm.stitchmatch", "", "with -rmm.stitchtraces: only the traces whose name contains this")

var stitchMinFlag = flag.Int("rmm.stitchmin", 0, "with -rmm.stitchtraces: poolTuning.stitchMin (0: the default; -1: the piece size)")

var stitchDevice = flag.Bool("rmm.stitchdevice", false, "with -rmm.stitchtraces: replay over the device's virtual memory (GPU 0) instead of an address-only one")

var stitchPassesFlag = flag.Int("rmm.stitchpasses", 10, "with -rmm.stitchtraces: the passes to replay (footprints are logged after 1, 3 and the last)")

var stitchRestOnly = flag.Bool("rmm.stitchrestonly", false, "with -rmm.stitchtraces: only the variants that grow the rest")

var stitchFracFlag = flag.Int("rmm.stitchfrac", 0, "with -rmm.stitchtraces: poolTuning.stitchFrac")

var stitchNoDepsFlag = flag.Bool("rmm.stitchnodeps", false, "with -rmm.stitchtraces: poolTuning.stitchNoDeps")

var stitchKeepFlag = flag.Int("rmm.stitchkeep", 0, "with -rmm.stitchtraces: poolTuning.stitchKeep (0: the default)")

var stitchMinGrowthFlag = flag.Int("rmm.mingrowth", 0, "with -rmm.stitchtraces: poolTuning.minGrowth, the least growth (0: the default)")

var stitchNoBaseFlag = flag.Bool("rmm.stitchnobase", false, "with -rmm.stitchtraces: leave out the pool without stitching")

var stitchGrowthDivFlag = flag.Int("rmm.growthdiv", 0, "with -rmm.stitchtraces: poolTuning.growthDivisor (0: the default)")

// TestStitchTraces is the measurement behind stitching's figures:
//
//	go test -run TestStitchTraces -rmm.stitchtraces 8388608,2097152,33554432 -v -timeout 1h
//
// Each line: a trace, then per variant the peak mapped / peak live after 1, 3 and 10 passes, the
// handles created, mappings made and unmaps in passes 1, 2, 3 and 10, the stitched ranges made and
// kept at the end, and the least wall time and process CPU time per event of passes 2 to 10
// (replay over the address-only VMM on this host; the least, as the host is shared and the
// passes after the first make the same calls).
func TestStitchTraces(t *testing.T) {
	if *stitchTraces == "" {
		t.Skip("a measurement: give -rmm.stitchtraces PIECE[,PIECE...]")
	}
	type variant struct {
		piece int
		rest  bool
	}
	var vs []variant
	if !*stitchNoBaseFlag {
		vs = append(vs, variant{0, false})
	}
	for _, x := range strings.Split(*stitchTraces, ",") {
		v, err := strconv.Atoi(x)
		require.NoError(t, err)
		if !*stitchRestOnly {
			vs = append(vs, variant{v, false})
		}
		vs = append(vs, variant{v, true})
	}
	files, err := filepath.Glob(filepath.Join("testdata", "traces", "*.csv.gz"))
	require.NoError(t, err)
	report := []int{1, 3, *stitchPassesFlag}
	maximum, newVMM := traceReplayVMM(t, *stitchDevice)
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".csv.gz")
		if !strings.Contains(name, *stitchMatch) {
			continue
		}
		events, err := ReadLogFile(f)
		require.NoError(t, err)
		for _, v := range vs {
			vm := newCountingVMM(newVMM())
			tune := poolTuning{stitchPiece: v.piece, stitchRest: v.rest, stitchKeep: *stitchKeepFlag, stitchFrac: *stitchFracFlag, stitchNoDeps: *stitchNoDepsFlag, minGrowth: *stitchMinGrowthFlag, growthDivisor: *stitchGrowthDivFlag}
			if *stitchMinFlag < 0 {
				tune.stitchMin = v.piece
			} else {
				tune.stitchMin = *stitchMinFlag
			}
			p := newTunedTestPool(t, vm, PoolOptions{MaximumPoolSize: maximum}, tune)
			peakLive := 0
			var prev vmmCounts
			var walls, cpus []time.Duration
			line := fmt.Sprintf("%-40s piece %2d MiB rest %-5v", name, v.piece>>20, v.rest)
			var ratios, calls []string
			for pass := 1; pass <= report[len(report)-1]; pass++ {
				start := time.Now()
				c0, _ := processCPUTime()
				r, err := Replay(events, p, nil)
				walls = append(walls, time.Since(start))
				c1, _ := processCPUTime()
				cpus = append(cpus, c1-c0)
				require.NoError(t, err)
				require.Zero(t, r.Failures)
				peakLive = max(peakLive, int(r.PeakLiveBytes))
				c := vm.counts()
				if slices.Contains(report, pass) {
					ratios = append(ratios, fmt.Sprintf("%.3f", float64(p.Stats().PeakPoolSize)/float64(peakLive)))
				}
				if pass <= 3 || pass == report[len(report)-1] {
					calls = append(calls, fmt.Sprintf("%d/%d/%d", c.creates-prev.creates, c.maps-prev.maps, c.unmaps-prev.unmaps))
				}
				prev = c
			}
			require.NoError(t, p.CheckInvariants())
			first := walls[0]
			walls, cpus = walls[1:], cpus[1:]
			slices.Sort(walls)
			slices.Sort(cpus)
			made, kept, evicted := 0, 0, 0
			if p.stitching() != nil {
				made, kept, evicted = p.stitching().stitches, len(p.stitching().aliases), p.stitching().evicted
			}
			t.Logf("%s | p1/p3/p%d %s | create/map/unmap %s | stitched %d kept %d evicted %d | pass 1 %d ns/event | later %d ns/event (CPU %d)", line, report[2],
				strings.Join(ratios, " "), strings.Join(calls, " "), made, kept, evicted, first.Nanoseconds()/int64(len(events)), walls[0].Nanoseconds()/int64(len(events)), cpus[0].Nanoseconds()/int64(len(events)))
			require.NoError(t, p.Close())
		}
	}
}

// TestStitchReplaysAtEnd replays a trace twice on a stitching pool (PoolOptions.Stitch's
// settings): where the first pass stitched a request while the end of the chain stood at an
// address, the second takes the same alias there rather than the memory the first pass's later
// growths left free at the end (keptAtEnd), and small requests are placed at the end of the
// chain only when nothing else holds them (endLast), so it maps no handle. Before keptAtEnd the
// graph network's second pass made 1,161 mappings, ResNet-50's 294; before endLast the UNet's
// made 2,791; before keptAtEnd looked at other streams' lists, the three-stream pipeline's made
// 1,117; before the end of the chain was served last in every list and the lists were no longer
// merged before a growth (findEndLast), the two-thread CuPy trace's made 151 and the
// three-stream CuPy pipeline's 563.
func TestStitchReplaysAtEnd(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	for _, name := range []string{"gnn_mpnn_varsize_fp32", "resnet50_train_b64_fp32", "unet_diffusion_multiscale_bf16", "torch_3streams_resnet18_encoder_fp16", "cupy_fft_linalg_2threads", "cupy_signal_3streams_1thread", "segformer_mit_train_varcrop_2streams_bf16"} {
		t.Run(name, func(t *testing.T) {
			// One trace for each change above: keptAtEnd, endLast, other streams' lists (three
			// streams), findEndLast (two threads).
			shortTraces(t, name, "resnet50_train_b64_fp32", "unet_diffusion_multiscale_bf16", "torch_3streams_resnet18_encoder_fp16", "cupy_fft_linalg_2threads")
			events, err := ReadLogFile(filepath.Join("testdata", "traces", name+".csv.gz"))
			require.NoError(t, err)
			vm := newCountingVMM(newSimVMM(hostVMMGranularity, 0))
			p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 40, Stitch: true})
			defer func() { require.NoError(t, p.Close()) }()
			_, err = Replay(events, p, nil)
			require.NoError(t, err)
			first := vm.counts()
			require.Positive(t, p.stitching().stitches, "the first pass stitches")
			r, err := Replay(events, p, nil)
			require.NoError(t, err)
			require.Zero(t, r.Failures)
			second := vm.counts()
			if name != "unet_diffusion_multiscale_bf16" {
				require.Equal(t, first.maps, second.maps, "the second pass maps no handle")
			} else {
				// Its request sizes change with the scale at each step, and pieces sized from the
				// requests (stitchReqDivDefault) leave its second pass a few aliases to stitch
				// that no kept one serves: few mappings beside the first pass's, none after.
				require.Less(t, second.maps-first.maps, first.maps/4, "the second pass maps few handles")
				_, err = Replay(events, p, nil)
				require.NoError(t, err)
				require.Equal(t, second.maps, vm.counts().maps, "the third pass maps no handle")
			}
			require.NoError(t, p.CheckInvariants())
		})
	}
}

// The three-stream trace lends kept aliases whose chunks lie in other streams' lists (keptAtEnd,
// 72 times over the two passes): over the fake device, with the model of stream order checking
// every allocation (e.alloc: each byte handed to a stream is ordered after its last free), both
// passes replay with no failure, the second maps no handle, and stitched blocks named other
// lists for Allocate to wait on. (Without those lists among the deps, the model saw stream 2
// handed bytes stream 3 had freed, at line 5783 of the first pass.)
//
// The model also replays the three multi-stream traces recorded after that change (the
// four-stream language-model service, the three-stream CuPy pipeline, and a GPT trained beside a
// side stream, recorded after findEndLast). Each pass gives every stream a new one and the last
// pass's stay alive, with their lists. The first two map no handle in their second pass there
// either (before findEndLast they mapped 43 and 563); the GPT maps 9,875 there (none in
// rmm-replay's passes, whose streams end with the pass; its third pass maps none either way):
// the side stream's list, left holding free memory by the first pass, places the second pass's
// requests elsewhere. The SegFormer maps none in its second pass since the end of the chain
// moves into the list of the stream that takes it (findEndLast; 7,739 before, here and in
// rmm-replay's passes).
func TestStitchTraceStreamOrder(t *testing.T) {
	t.Parallel() // seconds of work on its own resources: see TestMain
	for _, tc := range []struct {
		name      string
		steady    bool // the second pass maps no handle
		otherDeps bool // the second pass's stitched blocks lend out of other lists
	}{
		{"torch_3streams_resnet18_encoder_fp16", true, true},
		{"llm_serve_4streams_kvcache_fp16", true, false},
		{"cupy_signal_3streams_1thread", true, false},
		{"gpt_ema_sidestream_train_bf16", false, false},
		{"segformer_mit_train_varcrop_2streams_bf16", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			shortTraces(t, tc.name, "torch_3streams_resnet18_encoder_fp16", "llm_serve_4streams_kvcache_fp16") // other lists named; steady after findEndLast
			events, err := ReadLogFile(filepath.Join("testdata", "traces", tc.name+".csv.gz"))
			require.NoError(t, err)
			vm := newCountingVMM(newSimVMM(hostVMMGranularity, 0))
			p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 40, Stitch: true})
			e := newPoolSyncEnv(t, p)
			mr := &modelResource{e: e, num: map[uint64]int{DefaultStream.id: e.def}}
			opts := &ReplayOptions{
				Stream: func(h uintptr) StreamView {
					if h == 0 {
						return DefaultStream
					}
					// A stream of its own each pass, with a handle of its own (two live streams
					// never share a handle).
					k := uintptr(len(mr.num))
					v, _, i := e.stream(0x5000+k, fmt.Sprintf("S%d(%#x)", k, h))
					mr.num[v.id] = i
					return v
				},
				OnFailure: func(ev LogEvent, err error) { t.Errorf("line %d: %v", ev.Line, err) },
			}
			var maps [2]int
			var deps [2]int
			for pass := range 2 {
				r, err := Replay(events, mr, opts)
				require.NoError(t, err)
				require.Zero(t, r.Failures)
				maps[pass], deps[pass] = vm.counts().maps, p.stitching().stitchedDeps
			}
			require.Positive(t, p.stitching().stitches, "the trace stitches")
			t.Logf("second pass: %d maps", maps[1]-maps[0])
			if tc.steady {
				require.Equal(t, maps[0], maps[1], "the second pass maps no handle")
			}
			if tc.otherDeps {
				require.Greater(t, deps[1], deps[0], "stitched blocks of the second pass named other streams' lists")
			}
			e.done()
			require.NoError(t, p.Close())
		})
	}
}

// modelResource replays through a poolSyncEnv: every allocation is checked against its model.
type modelResource struct {
	e   *poolSyncEnv
	num map[uint64]int // the model's number of each stream, by StreamView.id
}

func (m *modelResource) Allocate(n int, s StreamView) (DevicePtr, error) {
	return m.e.alloc(n, s, m.num[s.id])
}

func (m *modelResource) Deallocate(ptr DevicePtr, n int, s StreamView) error {
	return m.e.free(ptr, n, s, m.num[s.id])
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
