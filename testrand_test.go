package rmm

// Helpers of the package's own random tests (the adaptor stack's and the containers' state
// machines, the VMM's, the pool's and the arena's stress tests). The contract checks of every
// resource live in package rmmtest; property_test.go drives them.
//
// The long tests (random walks, property tests, replays of the bundled traces) run a short form
// by default, so that the package's race run (go test -race ./..., the README's command and
// CI's) ends in a couple of minutes on two cores: fewer random cases, seeds, steps and passes
// (every mode and pool variant kept), and of the bundled traces a subset chosen to cover every
// shape the test replays (one stream and several, several threads, failed allocations) and every
// change it guards. The flag -rmm.long runs them at full length (.ci/run does, for the tests
// whose short form leaves out the same cases every run):
//
//	go test -race . -rmm.long
//
// RMM_PROPERTY_SCALE multiplies the random cases of either length; RMM_PROPERTY_SEED replays
// one.

import (
	"bytes"
	"flag"
	"fmt"
	"math"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/commands"
	"github.com/stretchr/testify/require"
)

const (
	kiB = 1 << 10
	miB = 1 << 20
	giB = 1 << 30
)

func roundUp(n int) int {
	r, _ := AlignUp(n, Alignment)
	return r
}

var longTests = flag.Bool("rmm.long", false, "run the long tests at full length: every random case, seed, pass and bundled trace (by default each runs a short form)")

// shortOrLong returns short, or long under -rmm.long: the random cases, seeds, passes or sizes
// of a long test.
func shortOrLong[T any](short, long T) T {
	if *longTests {
		return long
	}
	return short
}

// ShortOrLong is shortOrLong for the tests of package rmm_test (property_test.go).
func ShortOrLong[T any](short, long T) T { return shortOrLong(short, long) }

// shortTraces skips t, a subtest that replays the bundled trace name (its file name without
// .csv.gz), unless -rmm.long is set or name is one of short, the traces of the test's default
// run. Each of short must be a bundled trace, so that a misspelt name cannot leave the default
// run replaying none.
func shortTraces(t *testing.T, name string, short ...string) {
	t.Helper()
	for _, s := range short {
		if _, err := os.Stat(filepath.Join("testdata", "traces", s+".csv.gz")); err != nil {
			t.Fatalf("shortTraces: %v", err)
		}
	}
	if !*longTests && !slices.Contains(short, name) {
		t.Skipf("the default run replays %s of this test's traces; -rmm.long replays every one", strings.Join(short, ", "))
	}
}

// propertySeed returns RMM_PROPERTY_SEED, or a fresh seed.
func propertySeed(t *testing.T) int64 {
	if s := os.Getenv("RMM_PROPERTY_SEED"); s != "" {
		seed, err := strconv.ParseInt(s, 10, 64)
		require.NoError(t, err, "RMM_PROPERTY_SEED")
		return seed
	}
	return time.Now().UnixNano()
}

// propertyScale returns RMM_PROPERTY_SCALE (1 when unset): how many times as many random cases
// to run.
func propertyScale(t *testing.T) int {
	if s := os.Getenv("RMM_PROPERTY_SCALE"); s != "" {
		k, err := strconv.Atoi(s)
		require.NoError(t, err, "RMM_PROPERTY_SCALE")
		require.Positive(t, k, "RMM_PROPERTY_SCALE")
		return k
	}
	return 1
}

// logUniform returns a size in [lo, hi) drawn uniformly in log scale.
func logUniform(r *rand.Rand, lo, hi int) int {
	e := math.Log2(float64(lo)) + r.Float64()*(math.Log2(float64(hi))-math.Log2(float64(lo)))
	return max(lo, min(hi-1, int(math.Exp2(e))))
}

// smallSize draws from a mix of 0, 1..300, multiples of 256 up to 64 KiB, anything up to 64 KiB.
func smallSize(r *rand.Rand) int {
	switch k := r.Intn(100); {
	case k < 4:
		return 0
	case k < 45:
		return 1 + r.Intn(300)
	case k < 75:
		return Alignment * (1 + r.Intn(256))
	default:
		return 1 + r.Intn(64*kiB)
	}
}

// upstreamBlock is an address range handed out.
type upstreamBlock struct {
	addr DevicePtr
	size int
}

func (b upstreamBlock) String() string { return fmt.Sprintf("[%#x+%d]", uintptr(b.addr), b.size) }

// recordingUpstream passes calls to inner and records the blocks handed out and not yet taken
// back. A free of a block it did not hand out, or with another size, is recorded as misuse and
// refused.
type recordingUpstream struct {
	inner MemoryResource

	mu     sync.Mutex
	live   map[DevicePtr]int
	misuse error
}

func newRecordingUpstream(inner MemoryResource) *recordingUpstream {
	return &recordingUpstream{inner: inner, live: map[DevicePtr]int{}}
}

func (u *recordingUpstream) Allocate(n int, s StreamView) (DevicePtr, error) {
	p, err := u.inner.Allocate(n, s)
	if err != nil || n == 0 {
		return p, err
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if _, dup := u.live[p]; dup && u.misuse == nil {
		u.misuse = fmt.Errorf("the upstream handed out %#x twice", uintptr(p))
	}
	u.live[p] = n
	return p, nil
}

func (u *recordingUpstream) Deallocate(p DevicePtr, n int, s StreamView) error {
	if p != 0 {
		u.mu.Lock()
		size, ok := u.live[p]
		if !ok || size != n {
			err := fmt.Errorf("%w: recording upstream: Deallocate(%#x, %d): handed out with size %d (0: not handed out)", ErrInvalidFree, uintptr(p), n, size)
			if u.misuse == nil {
				u.misuse = err
			}
			u.mu.Unlock()
			return err
		}
		delete(u.live, p)
		u.mu.Unlock()
	}
	return u.inner.Deallocate(p, n, s)
}

func (u *recordingUpstream) Access() Access { return AccessOf(u.inner) }

// blocks returns the blocks held, in address order, and the first misuse seen.
func (u *recordingUpstream) blocks() ([]upstreamBlock, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	bs := make([]upstreamBlock, 0, len(u.live))
	for p, n := range u.live {
		bs = append(bs, upstreamBlock{p, n})
	}
	sort.Slice(bs, func(i, j int) bool { return bs[i].addr < bs[j].addr })
	return bs, u.misuse
}

// liveSet is the set of address ranges live at once across goroutines; a range is in it only
// between Allocate's return and the call to Deallocate, so any overlap is the resource's fault.
type liveSet struct {
	mu    sync.Mutex
	spans []upstreamBlock // sorted by address
}

func (l *liveSet) add(p DevicePtr, n int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	i := sort.Search(len(l.spans), func(i int) bool { return l.spans[i].addr >= p })
	if i < len(l.spans) && l.spans[i].addr < p+DevicePtr(n) {
		return fmt.Errorf("[%#x, +%d) overlaps live %v", uintptr(p), n, l.spans[i])
	}
	if i > 0 && l.spans[i-1].addr+DevicePtr(l.spans[i-1].size) > p {
		return fmt.Errorf("[%#x, +%d) overlaps live %v", uintptr(p), n, l.spans[i-1])
	}
	l.spans = slices.Insert(l.spans, i, upstreamBlock{p, n})
	return nil
}

func (l *liveSet) remove(p DevicePtr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	i := sort.Search(len(l.spans), func(i int) bool { return l.spans[i].addr >= p })
	l.spans = slices.Delete(l.spans, i, i+1)
}

// runCommandsProperty checks cmds (a gopter state machine) as the property name with params,
// made from seed: on a failure it fails t with gopter's report (the shrunk sequence) and the
// command that replays the seed; else it logs the report.
func runCommandsProperty(t *testing.T, seed int64, params *gopter.TestParameters, name string, cmds *commands.ProtoCommands) {
	t.Helper()
	props := gopter.NewProperties(params)
	props.Property(name, commands.Prop(cmds))
	var out bytes.Buffer
	if !props.Run(gopter.NewFormatedReporter(true, 160, &out)) {
		t.Fatalf("%s\nseed %d: replay with RMM_PROPERTY_SEED=%d go test -race -run '^%s$'", out.String(), seed, seed, t.Name())
	}
	t.Log(strings.TrimSpace(out.String()))
}
