package workload_test

import (
	"errors"
	"testing"

	"github.com/gormm/rmm"
	"github.com/gormm/rmm/internal/workload"
	"github.com/stretchr/testify/require"
)

// checkLog checks what every log of the generator must hold: time never decreases, thread 0,
// positive sizes, every free matches a live allocation of its size and stream, live allocations
// never overlap (addresses only grow), nothing is left live at the end, and the weights (the
// first allocations: 12 tensors a layer, the embeddings and the final norm's two) are the last
// freed. It returns the peak live bytes.
func checkLog(t *testing.T, events []rmm.LogEvent, layers int) (peak int64) {
	t.Helper()
	type alloc struct {
		size   int
		stream uintptr
	}
	live := map[rmm.DevicePtr]alloc{}
	var liveBytes int64
	var end rmm.DevicePtr // end of the highest allocation so far
	weights := 12*layers + 4
	// Plain comparisons: require's per call cost would dominate over hundreds of thousands of
	// events.
	for i, e := range events {
		if e.Thread != 0 || e.Size <= 0 || (i > 0 && e.Time < events[i-1].Time) {
			t.Fatalf("event %d: %+v (thread 0, a positive size and a time that never goes back)", i, e)
		}
		switch e.Action {
		case rmm.ActionAllocate:
			if e.Pointer < end {
				t.Fatalf("event %d: %#x overlaps an earlier allocation", i, e.Pointer)
			}
			end = e.Pointer + rmm.DevicePtr(e.Size)
			live[e.Pointer] = alloc{e.Size, e.Stream}
			liveBytes += int64(e.Size)
			peak = max(peak, liveBytes)
		case rmm.ActionFree:
			a, ok := live[e.Pointer]
			if !ok || a != (alloc{e.Size, e.Stream}) {
				t.Fatalf("event %d: free of %#x (%d bytes, stream %#x): live as %+v, %v", i, e.Pointer, e.Size, e.Stream, a, ok)
			}
			delete(live, e.Pointer)
			liveBytes -= int64(e.Size)
		default:
			t.Fatalf("event %d: action %v", i, e.Action)
		}
	}
	require.Empty(t, live, "left live")
	for i, e := range events[len(events)-weights:] {
		require.Equal(t, rmm.ActionFree, e.Action)
		require.Equal(t, events[i].Pointer, e.Pointer, "the weights are freed last, in their order")
	}
	return peak
}

func TestServingLog(t *testing.T) {
	cfg := workload.ServingConfig{Seed: 7, Events: 200_000}
	events, err := workload.ServingEvents(cfg)
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(events), cfg.Events)
	require.Less(t, len(events), cfg.Events+20_000, "the end frees what is live, no more")
	peak := checkLog(t, events, 16)
	require.Greater(t, peak, int64(3<<30), "the weights alone are a few GiB")
	require.Less(t, peak, int64(64<<30))

	again, err := workload.ServingEvents(cfg)
	require.NoError(t, err)
	require.Equal(t, events, again, "the same configuration gives the same events")
	cfg.Seed = 8
	other, err := workload.ServingEvents(cfg)
	require.NoError(t, err)
	require.NotEqual(t, events[:20_000], other[:20_000], "another seed gives other events")
}

// The shapes keep changing: the sizes of the allocations made after the first half of a log
// are mostly sizes its first half never asked for.
func TestServingShapesDoNotRepeat(t *testing.T) {
	events, err := workload.ServingEvents(workload.ServingConfig{Seed: 3, Events: 400_000})
	require.NoError(t, err)
	seen := map[int]bool{}
	for _, e := range events[:len(events)/2] {
		seen[e.Size] = true
	}
	sizes := map[int]bool{}
	for _, e := range events[len(events)/2:] {
		if e.Action == rmm.ActionAllocate && e.Size >= 1<<20 {
			sizes[e.Size] = true
		}
	}
	fresh := 0
	for s := range sizes {
		if !seen[s] {
			fresh++
		}
	}
	require.Greater(t, fresh, len(sizes)/2, "%d of %d sizes of 1 MiB and more new in the second half", fresh, len(sizes))
}

func TestServingConfig(t *testing.T) {
	g, err := workload.NewServing(workload.ServingConfig{})
	require.NoError(t, err)
	require.Equal(t, workload.ServingConfig{Events: 1_000_000, Layers: 16, Hidden: 3072, Vocab: 50304, MaxInFlight: 4,
		MaxContext: 4096, KVBlock: 1, OneOffs: 0.02}, g.Config())
	for _, cfg := range []workload.ServingConfig{
		{Events: -1}, {Layers: -2}, {Hidden: 1000}, {MaxContext: 1}, {KVBlock: -1},
		{SideStream: 1.5}, {SideStream: -0.1}, {OneOffs: 2},
	} {
		_, err := workload.NewServing(cfg)
		require.True(t, errors.Is(err, workload.ErrConfig), "%+v: %v", cfg, err)
	}
}

// The knobs: a second stream for some requests, larger cache blocks, no one-offs, a small model.
func TestServingKnobs(t *testing.T) {
	base := workload.ServingConfig{Seed: 5, Events: 100_000, Layers: 4, Hidden: 1024, Vocab: 32000}
	side := base
	side.SideStream = 0.5
	events, err := workload.ServingEvents(side)
	require.NoError(t, err)
	checkLog(t, events, base.Layers)
	streams := map[uintptr]int{}
	for _, e := range events {
		streams[e.Stream]++
	}
	require.Len(t, streams, 2)
	require.Greater(t, streams[0x1], len(events)/5)

	count := func(cfg workload.ServingConfig) (allocs int) {
		events, err := workload.ServingEvents(cfg)
		require.NoError(t, err)
		checkLog(t, events, cfg.Layers)
		for _, e := range events {
			if e.Action == rmm.ActionAllocate {
				allocs++
			}
		}
		return allocs
	}
	block := base
	block.KVBlock = 64
	require.Greater(t, count(block), count(base), "fewer cache reallocations leave room for more steps")

	g, err := workload.NewServing(workload.ServingConfig{Seed: 5, Events: 300_000, Layers: 4, Hidden: 1024, OneOffs: -1})
	require.NoError(t, err)
	for range g.All() {
	}
	requests, oneOffs := g.Requests()
	require.Positive(t, requests)
	require.Zero(t, oneOffs)
}

func TestServingNextAfterEnd(t *testing.T) {
	g, err := workload.NewServing(workload.ServingConfig{Seed: 1, Events: 1000, Layers: 2, Hidden: 256})
	require.NoError(t, err)
	n := 0
	for range g.All() {
		n++
	}
	require.GreaterOrEqual(t, n, 1000)
	_, ok := g.Next()
	require.False(t, ok)
}

// Sizes that overflow: a configuration whose weights or largest tensors do not fit in memory
// anyone has is refused, rather than logging negative or wrapped sizes.
func TestServingHugeSizesAreConfigErrors(t *testing.T) {
	for _, cfg := range []workload.ServingConfig{
		{Events: 10, Hidden: 1280000000},
		{Events: 10, Hidden: 1 << 20, Vocab: 1 << 40},
		{Events: 10, MaxContext: 1 << 50},
	} {
		_, err := workload.NewServing(cfg)
		require.ErrorIs(t, err, workload.ErrConfig, "%+v", cfg)
	}
}
