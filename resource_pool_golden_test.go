package rmm

import (
	"flag"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

var poolGolden = flag.String("rmm.golden", "", "write the pool's behaviour on every bundled trace to this file: for the plain, expandable and stitching pools over address-only memory, at passes 1 to 3, a digest of every address handed out, the driver or upstream calls and the footprint (compare two builds' files with diff; skipped without it)")

var poolGoldenMatch = flag.String("rmm.goldenmatch", "", "with -rmm.golden: only the traces whose name contains this")

// placementDigest wraps a resource and hashes every address and size it hands out, in order.
type placementDigest struct {
	MemoryResource
	mu sync.Mutex
	h  uint64
}

func (d *placementDigest) Allocate(n int, s StreamView) (DevicePtr, error) {
	p, err := d.MemoryResource.Allocate(n, s)
	d.mu.Lock()
	defer d.mu.Unlock()
	if err != nil {
		p = ^DevicePtr(0)
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%x %x %x;", d.h, uintptr(p), n)
	d.h = h.Sum64()
	return p, err
}

func (d *placementDigest) Upstream() MemoryResource { return d.MemoryResource }

// countingUpstream counts a plain pool's calls to its upstream.
type countingUpstream struct {
	MemoryResource
	allocs, frees int
}

func (c *countingUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	p, err := c.MemoryResource.Allocate(n, s)
	if err == nil {
		c.allocs++
	}
	return p, err
}

func (c *countingUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	c.frees++
	return c.MemoryResource.Deallocate(p, n, s)
}

// TestPoolGolden records what the pool does on every bundled trace, so that a change meant to
// keep behaviour (a refactor) can be checked against the build before it:
//
//	go test -run TestPoolGolden -rmm.golden /tmp/before.txt -timeout 1h
//	(change)
//	go test -run TestPoolGolden -rmm.golden /tmp/after.txt -timeout 1h
//	diff /tmp/before.txt /tmp/after.txt
//
// Each line: trace, pool, pass, a digest of every (address, size) handed out in order, failures,
// peak pool size, and the calls made so far (upstream allocations and frees for the plain pool;
// creates, maps, unmaps, releases and set-access calls for the others). Events replay serially;
// the third pass follows a Release.
func TestPoolGolden(t *testing.T) {
	if *poolGolden == "" {
		t.Skip("a measurement: give -rmm.golden FILE")
	}
	files, err := filepath.Glob(filepath.Join("testdata", "traces", "*.csv.gz"))
	require.NoError(t, err)
	var out strings.Builder
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".csv.gz")
		if !strings.Contains(name, *poolGoldenMatch) {
			continue
		}
		events, err := ReadLogFile(f)
		require.NoError(t, err)
		for _, kind := range []string{"plain", "expandable", "stitch"} {
			var p *PoolMemoryResource
			var up *countingUpstream
			var vm *countingVMM
			switch kind {
			case "plain":
				sim, err := NewSimulatedMemoryResource(1 << 40)
				require.NoError(t, err)
				up = &countingUpstream{MemoryResource: sim}
				p, err = NewPoolMemoryResource(up, nil)
				require.NoError(t, err)
			default:
				vm = newCountingVMM(newSimVMM(hostVMMGranularity, 0))
				p = newExpTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 40, Stitch: kind == "stitch"})
			}
			d := &placementDigest{MemoryResource: p}
			for pass := 1; pass <= 3; pass++ {
				if pass == 3 {
					// The third pass starts from a pool that gave back what it could.
					require.NoError(t, p.Release())
				}
				r, err := Replay(events, d, &ReplayOptions{Serial: true})
				require.NoError(t, err)
				require.NoError(t, p.CheckInvariants())
				var calls string
				if up != nil {
					calls = fmt.Sprintf("upstream %d/%d", up.allocs, up.frees)
				} else {
					c := vm.counts()
					calls = fmt.Sprintf("vmm %d/%d/%d/%d/%d", c.creates, c.maps, c.unmaps, c.releases, c.access)
				}
				fmt.Fprintf(&out, "%s %s p%d digest %016x failures %d peak %d %s\n", name, kind, pass, d.h, r.Failures, p.Stats().PeakPoolSize, calls)
			}
			require.NoError(t, p.Close())
		}
	}
	require.NoError(t, os.WriteFile(*poolGolden, []byte(out.String()), 0o644))
}
