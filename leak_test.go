package rmm

import (
	"fmt"
	"log/slog"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// captureDebugLog routes the debug log to a recordHandler for the test.
func captureDebugLog(t *testing.T) *recordHandler {
	h := &recordHandler{}
	old := SetDebugLogger(slog.New(h))
	t.Cleanup(func() { SetDebugLogger(old) })
	return h
}

// awaitReclaim runs the collector until mr has seen wantFrees frees and logs holds wantLogs
// records (the cleanup frees, then logs), or gives up after many rounds.
func awaitReclaim(t *testing.T, mr *testResource, wantFrees int, logs *recordHandler, wantLogs int) {
	t.Helper()
	for range 200 {
		if _, frees, _ := mr.counts(); frees >= wantFrees && logs.count.Load() >= int64(wantLogs) {
			return
		}
		runtime.GC()
		select {
		case <-mr.freed:
		case <-time.After(20 * time.Millisecond):
		}
	}
	_, frees, _ := mr.counts()
	t.Fatalf("after 200 collections: %d frees (want %d), %d log records (want %d)", frees, wantFrees, logs.count.Load(), wantLogs)
}

//go:noinline
func leakUvector(mr MemoryResource, s StreamView) (DevicePtr, error) {
	v, err := NewUvector[float64](1000, s, mr)
	if err != nil {
		return 0, err
	}
	require.NoError(nilT{}, v.Fill(1, s))
	return v.Data(), nil
}

//go:noinline
func leakBufferAndScalar(mr MemoryResource) (DevicePtr, DevicePtr, error) {
	b, err := NewDeviceBuffer(333, DefaultStream, mr)
	if err != nil {
		return 0, 0, err
	}
	c, err := NewScalar[int16](DefaultStream, mr)
	if err != nil {
		return 0, 0, err
	}
	return b.Data(), c.Data(), nil
}

// nilT satisfies require.TestingT outside a test's goroutine-bound T.
type nilT struct{}

func (nilT) Errorf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (nilT) FailNow()                          { panic("FailNow") }

func TestLeakedContainersAreReclaimed(t *testing.T) {
	logs := captureDebugLog(t)
	mr := newTestResource()
	s := newHostStream(t)

	p, err := leakUvector(mr, s)
	require.NoError(t, err)
	awaitReclaim(t, mr, 1, logs, 1)
	_, _, live := mr.counts()
	assert.Zero(t, live)
	assert.Equal(t, s, mr.lastFreeS, "freed on the container's stream")

	pb, pc, err := leakBufferAndScalar(mr)
	require.NoError(t, err)
	awaitReclaim(t, mr, 3, logs, 3)
	_, _, live = mr.counts()
	assert.Zero(t, live)

	recs := ours(logs.all(), p, pb, pc) // other tests' leaks, if any, are not ours to judge
	require.Len(t, recs, 3)
	byType := map[string]map[string]any{}
	for _, r := range recs {
		assert.Equal(t, slog.LevelWarn, r["level"])
		assert.Contains(t, r["msg"], "leak")
		assert.Equal(t, "testResource", r["resource"])
		byType[r["type"].(string)] = r
	}
	require.Contains(t, byType, "Uvector[float64]")
	assert.EqualValues(t, 8000, byType["Uvector[float64]"]["bytes"])
	assert.Equal(t, fmt.Sprintf("%#x", uintptr(p)), byType["Uvector[float64]"]["ptr"])
	assert.Equal(t, s.String(), byType["Uvector[float64]"]["stream"])
	require.Contains(t, byType, "DeviceBuffer")
	assert.EqualValues(t, 333, byType["DeviceBuffer"]["bytes"])
	assert.Equal(t, fmt.Sprintf("%#x", uintptr(pb)), byType["DeviceBuffer"]["ptr"])
	require.Contains(t, byType, "Scalar[int16]")
	assert.EqualValues(t, 2, byType["Scalar[int16]"]["bytes"])
	assert.Equal(t, fmt.Sprintf("%#x", uintptr(pc)), byType["Scalar[int16]"]["ptr"])
}

// ours keeps the records about the given pointers.
func ours(recs []map[string]any, ptrs ...DevicePtr) []map[string]any {
	want := map[any]bool{}
	for _, p := range ptrs {
		want[fmt.Sprintf("%#x", uintptr(p))] = true
	}
	var out []map[string]any
	for _, r := range recs {
		if want[r["ptr"]] {
			out = append(out, r)
		}
	}
	return out
}

//go:noinline
func closeAndDrop(mr MemoryResource) error {
	v, err := NewUvector[int32](10, DefaultStream, mr)
	if err != nil {
		return err
	}
	if err := v.Close(); err != nil {
		return err
	}
	b, err := NewDeviceBuffer(64, DefaultStream, mr)
	if err != nil {
		return err
	}
	p, n := b.Release() // the caller owns it now: no cleanup may free it
	return mr.Deallocate(p, n, DefaultStream)
}

//go:noinline
func releaseAndDrop(mr MemoryResource) (*DeviceBuffer, error) {
	v, err := NewUvector[int32](10, DefaultStream, mr)
	if err != nil {
		return nil, err
	}
	return v.Release(), nil
}

func TestClosedOrReleasedContainersAreNotReclaimed(t *testing.T) {
	logs := captureDebugLog(t)
	mr := newTestResource()
	require.NoError(t, closeAndDrop(mr))
	b, err := releaseAndDrop(mr) // the vector is dropped; its memory lives in b
	require.NoError(t, err)
	for range 5 {
		runtime.GC()
		time.Sleep(5 * time.Millisecond)
	}
	allocs, frees, live := mr.counts()
	assert.Equal(t, []int{3, 2, 1}, []int{allocs, frees, live}, "no free beyond Close and the caller's")
	assert.Empty(t, logs.all())
	require.NoError(t, b.Close())
	runtime.KeepAlive(b)
	_, _, live = mr.counts()
	assert.Zero(t, live)
}
