package rmm

import (
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// PoolStats.VMM counts the calls the VMM under the pool saw, pass after pass, with a Release
// and a Close between them; the stitched ranges kept are the aliases the pool holds, and the
// address space reserved is its range plus theirs.
func TestPoolStatsVMM(t *testing.T) {
	for _, trace := range []string{"cupy_fft_linalg_2threads", "segformer_mit_train_varcrop_2streams_bf16"} {
		for _, stitch := range []bool{false, true} {
			events, err := ReadLogFile(filepath.Join("testdata", "traces", trace+".csv.gz"))
			require.NoError(t, err)
			vm := newCountingVMM(newSimVMM(hostVMMGranularity, 0))
			p := newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 40, Stitch: stitch})
			check := func(when string) {
				t.Helper()
				st := p.Stats().VMM
				c := vm.counts()
				require.Equal(t, VMMStats{
					Creates: c.creates, Maps: c.maps, SetAccess: c.access, Unmaps: c.unmaps, Releases: c.releases,
					Reserves: c.reserves, AddressFrees: c.frees,
					AddressReserved: st.AddressReserved,
					StitchedRanges:  st.StitchedRanges, StitchedKept: st.StitchedKept, StitchedEvicted: st.StitchedEvicted,
				}, st, "%s, stitch %v, %s", trace, stitch, when)
				want := p.expandable().reserved
				if s := p.stitching(); s != nil {
					require.Equal(t, len(s.aliases), st.StitchedKept)
					for _, a := range s.aliases {
						want += a.size
					}
				} else {
					require.Zero(t, st.StitchedRanges)
				}
				require.Equal(t, want, st.AddressReserved, "%s, stitch %v, %s", trace, stitch, when)
				require.Equal(t, st.StitchedRanges-st.StitchedEvicted, st.StitchedKept)
				require.Equal(t, st.Reserves-st.AddressFrees, 1+st.StitchedKept, "one reservation for the pool and one per kept range")
			}
			check("new")
			for pass := 1; pass <= 3; pass++ {
				if pass == 3 {
					require.NoError(t, p.Release())
					check("after Release")
				}
				_, err := Replay(events, p, &ReplayOptions{Serial: true})
				require.NoError(t, err)
				check("after a pass")
			}
			st := p.Stats().VMM
			require.Positive(t, st.Creates)
			require.GreaterOrEqual(t, st.Maps, st.Creates)
			if stitch {
				require.Positive(t, st.StitchedRanges, "the trace stitches")
			}
			require.NoError(t, p.Close())
			st = p.Stats().VMM
			require.Zero(t, st.AddressReserved, "Close frees every reservation")
			require.Equal(t, st.Creates, st.Releases, "Close gives back every handle")
		}
	}
}
