//go:build linux

package rmm

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

const fdBudgetHelperEnv = "RMM_TEST_FD_BUDGET_HELPER"

// runFDBudgetHelper runs test in a child process whose soft limit on open files is limit.
func runFDBudgetHelper(t *testing.T, test string, limit int) string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.count=1", "-test.v", "-test.timeout=120s")
	cmd.Env = append(os.Environ(), fdBudgetHelperEnv+"="+strconv.Itoa(limit))
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "--- PASS: "+test)
	return string(out)
}

// fdBudgetChild lowers the soft limit on open files to the one the parent asked, or skips when
// not the child.
func fdBudgetChild(t *testing.T) int {
	s := os.Getenv(fdBudgetHelperEnv)
	if s == "" {
		t.Skip("run by its parent test in a process with a low limit on open files")
	}
	limit, err := strconv.Atoi(s)
	require.NoError(t, err)
	var r unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &r))
	r.Cur = uint64(limit)
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &r))
	return limit
}

// A stitching pool over host memory, fragmented so that most of its growths map only what a
// request lacks: it must hold at most half of the limit on open files (its pieces are sized for
// that), and a growth that cannot be had must fail as out of memory, not with EMFILE.
func TestStitchingPoolFragmentedGrowthStaysWithinDescriptorBudget(t *testing.T) {
	if os.Getenv(fdBudgetHelperEnv) == "" {
		if !hostVMMSupported || CUDAAvailable() == nil {
			t.Skip("host-memory stitching pool only")
		}
		out := runFDBudgetHelper(t, "TestStitchingPoolFragmentedGrowthStaysWithinDescriptorBudgetChild", 100)
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, "memfds held") {
				t.Log(strings.TrimSpace(l))
			}
		}
	}
}

func TestStitchingPoolFragmentedGrowthStaysWithinDescriptorBudgetChild(t *testing.T) {
	limit := fdBudgetChild(t)
	require.NoError(t, Reinitialize(&ReinitializeOptions{PoolAllocator: true, InitialPoolSize: 2 << 20, MaximumPoolSize: 1 << 30}))
	t.Cleanup(func() { require.NoError(t, Reinitialize(nil)) })
	mr := CurrentDeviceResource()
	pool, ok := mr.(*PoolMemoryResource)
	require.True(t, ok, "%T", mr)

	type alloc struct {
		p DevicePtr
		n int
	}
	var live []alloc
	most := 0
	step := func(n int) error {
		p, err := mr.Allocate(n, DefaultStream)
		if err != nil {
			return err
		}
		live = append(live, alloc{p, n})
		st := pool.Stats()
		most = max(most, st.VMM.Creates-st.VMM.Releases)
		return nil
	}
	for range 256 {
		require.NoError(t, step(1<<20))
	}
	// Every other 1 MiB block free: the pool's free bytes hold each later request, but no free
	// block does.
	kept := live[:0]
	for i, a := range live {
		if i%2 == 0 {
			require.NoError(t, mr.Deallocate(a.p, a.n, DefaultStream))
		} else {
			kept = append(kept, a)
		}
	}
	live = kept
	var err error
	for range 400 {
		if err = step(3 << 20); err != nil {
			break
		}
	}
	t.Logf("memfds held: at most %d (limit %d), pool %d MiB, error %v", most, limit, pool.Stats().PoolSize>>20, err)
	if err != nil {
		require.ErrorIs(t, err, ErrOutOfMemory, "a growth past the descriptor budget fails as out of memory")
	}
	require.LessOrEqual(t, most, limit/2, "handles held at once")
	for _, a := range live {
		require.NoError(t, mr.Deallocate(a.p, a.n, DefaultStream))
	}
}
