package rmm

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// reinitIsolate restores device 0's resource, and forgets what Reinitialize made, when the test
// ends.
func reinitIsolate(t *testing.T) {
	t.Helper()
	prev, err := PerDeviceResource(0)
	require.NoError(t, err)
	t.Cleanup(func() {
		reinitMu.Lock()
		err := reinitTeardown()
		reinitMu.Unlock()
		assert.NoError(t, err)
		_, err = SetPerDeviceResource(0, prev)
		assert.NoError(t, err)
	})
}

func TestDeviceLogFileName(t *testing.T) {
	wd, err := os.Getwd()
	require.NoError(t, err)
	base := t.TempDir()
	in := func(p ...string) string { return filepath.Join(append([]string{base}, p...)...) }
	for _, c := range []struct {
		name string
		dev  Device
		want string
	}{
		{"rmm_log.csv", 0, filepath.Join(wd, "rmm_log.dev0.csv")},
		{in("rmm", "events.csv"), 3, in("rmm", "events.dev3.csv")},
		{in("log"), 1, in("log.dev1")},
		{in("a.tar.gz"), 2, in("a.tar.dev2.gz")},
		{in(".hidden"), 0, in(".hidden.dev0")},
		{in("..x"), 0, in("..x.dev0")},
		{in(".x.csv"), 0, in(".x.dev0.csv")},
		{in("dir.v2", "log"), 0, in("dir.v2", "log.dev0")},
		{in("trailing."), 0, in("trailing.dev0.")},
		{filepath.Join("sub", "..", "x.csv"), 12, filepath.Join(wd, "x.dev12.csv")},
	} {
		got, err := deviceLogFileName(c.name, c.dev)
		require.NoError(t, err, c.name)
		assert.Equal(t, c.want, got, c.name)
	}

	t.Setenv("RMM_LOG_FILE", in("from_env.csv"))
	got, err := deviceLogFileName("", 1)
	require.NoError(t, err)
	assert.Equal(t, in("from_env.dev1.csv"), got)
	t.Setenv("RMM_LOG_FILE", "")
	_, err = deviceLogFileName("", 0)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Contains(t, err.Error(), "RMM_LOG_FILE")
}

func TestReinitializeOptionsValidation(t *testing.T) {
	reinitIsolate(t)
	t.Setenv("RMM_LOG_FILE", "")
	hookRuns := 0
	defer RegisterReinitializeHook(func() { hookRuns++ })()
	before := CurrentDeviceResource()
	for name, o := range map[string]ReinitializeOptions{
		"negative initial":       {PoolAllocator: true, InitialPoolSize: -256},
		"plain without pool":     {Pool: PlainPool},
		"negative maximum":       {PoolAllocator: true, MaximumPoolSize: -256},
		"initial not aligned":    {PoolAllocator: true, InitialPoolSize: 1000},
		"maximum not aligned":    {PoolAllocator: true, MaximumPoolSize: 1<<20 + 1, InitialPoolSize: 256},
		"initial above maximum":  {PoolAllocator: true, InitialPoolSize: 2 << 20, MaximumPoolSize: 1 << 20},
		"sizes without pool":     {InitialPoolSize: 1 << 20},
		"maximum without pool":   {MaximumPoolSize: 1 << 20},
		"no such device":         {Devices: []Device{Device(DeviceCount() + 1)}},
		"negative device":        {Devices: []Device{-1}},
		"device twice":           {Devices: []Device{0, 0}},
		"logging without a name": {Logging: true},
		"name without logging":   {LogFileName: "x.csv"},
	} {
		err := Reinitialize(&o)
		require.ErrorIs(t, err, ErrInvalidArgument, name)
		require.Contains(t, err.Error(), "Reinitialize", name)
	}
	require.Zero(t, hookRuns, "no hook runs when the options are refused")
	require.Equal(t, before, CurrentDeviceResource(), "nothing changed")
}

func TestReinitializeHooksRunInReverseOrder(t *testing.T) {
	reinitIsolate(t)
	var order []int
	u1 := RegisterReinitializeHook(func() { order = append(order, 1) })
	u2 := RegisterReinitializeHook(func() { order = append(order, 2) })
	u3 := RegisterReinitializeHook(func() { order = append(order, 3) })
	defer u1()
	defer u3()
	noop := RegisterReinitializeHook(nil)
	noop()

	require.NoError(t, Reinitialize(nil))
	require.Equal(t, []int{3, 2, 1}, order)

	u2()
	u2() // a second call does nothing
	order = nil
	require.NoError(t, Reinitialize(nil))
	require.Equal(t, []int{3, 1}, order)

	// A hook sees the resources of the previous set-up still installed.
	require.NoError(t, Reinitialize(&ReinitializeOptions{PoolAllocator: true, InitialPoolSize: 1 << 20}))
	var seen MemoryResource
	u4 := RegisterReinitializeHook(func() { seen = CurrentDeviceResource() })
	defer u4()
	require.NoError(t, Reinitialize(nil))
	_, isPool := seen.(*PoolMemoryResource)
	require.True(t, isPool, "the hook ran before the pool was taken off: saw %T", seen)
}

func TestReinitializePool(t *testing.T) {
	reinitIsolate(t)
	cur := CurrentDevice()
	require.NoError(t, Reinitialize(&ReinitializeOptions{PoolAllocator: true, InitialPoolSize: 2 << 20, MaximumPoolSize: 8 << 20}))
	require.Equal(t, cur, CurrentDevice())
	pool, ok := CurrentDeviceResource().(*PoolMemoryResource)
	require.True(t, ok, "got %T", CurrentDeviceResource())
	require.Equal(t, 2<<20, pool.PoolSize())
	require.Equal(t, 8<<20, pool.MaximumPoolSize())
	if CUDAAvailable() == nil {
		_, ok = pool.Upstream().(*CudaMemoryResource)
		want := PlainPool
		if vmmSupported(cur) {
			want = StitchingPool
		}
		require.Equal(t, want, pool.Kind(), "stitching where the device has virtual memory management")
	} else {
		_, ok = pool.Upstream().(*SystemMemoryResource)
		want := PlainPool
		if hostVMMSupported {
			want = StitchingPool
		}
		require.Equal(t, want, pool.Kind(), "host memory: stitching where memfds can be had")
	}
	require.True(t, ok, "upstream %T", pool.Upstream())
	require.Empty(t, LogFileNames())

	v, err := NewUvector[int32](1000, DefaultStream, nil)
	require.NoError(t, err)
	require.NoError(t, v.Fill(5, DefaultStream))
	require.Equal(t, 1, pool.Stats().LiveAllocations)

	// Reinitializing takes the pool off and closes it; memory still allocated from it stays
	// valid and is freed through it.
	require.NoError(t, Reinitialize(nil))
	_, ok = CurrentDeviceResource().(*PoolMemoryResource)
	require.False(t, ok)
	_, err = pool.Allocate(256, DefaultStream)
	require.ErrorIs(t, err, ErrClosed)
	x, err := v.Element(999, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, int32(5), x)
	require.NoError(t, v.Close())
	require.Zero(t, pool.Stats().LiveAllocations)
}

func TestReinitializeDefaultPoolSize(t *testing.T) {
	free, total, err := Device(0).MemoryInfo()
	if err != nil {
		t.Skipf("no memory figures here: %v", err)
	}
	n, err := reinitDefaultPoolSize(0, 0)
	require.NoError(t, err)
	require.Zero(t, n%Alignment)
	require.Positive(t, n)
	require.LessOrEqual(t, n, total/2)
	require.InDelta(t, float64(free)/2, float64(n), float64(total)/20, "half of the free memory")
	n, err = reinitDefaultPoolSize(0, 1<<20)
	require.NoError(t, err)
	require.Equal(t, 1<<20, n, "capped by the maximum")
}

// With InitialPoolSize 0 the expandable kinds start empty and grow as asked; librmm's pool
// starts at half the free memory, as Python's default.
func TestReinitializeDefaultInitialSizeByKind(t *testing.T) {
	reinitIsolate(t)
	if _, _, err := Device(0).MemoryInfo(); err != nil {
		t.Skipf("no memory figures here: %v", err)
	}
	for _, k := range []PoolKind{StitchingPool, ExpandablePool, PlainPool} {
		require.NoError(t, Reinitialize(&ReinitializeOptions{PoolAllocator: true, Pool: k, MaximumPoolSize: 1 << 30}))
		pool, ok := CurrentDeviceResource().(*PoolMemoryResource)
		require.True(t, ok, "got %T", CurrentDeviceResource())
		if pool.Kind() == PlainPool {
			want, err := reinitDefaultPoolSize(0, 1<<30)
			require.NoError(t, err)
			require.Equal(t, want, pool.PoolSize(), "Pool: %s (built %s): half the free memory, capped by the maximum", k, pool.Kind())
			continue
		}
		require.Zero(t, pool.PoolSize(), "Pool: %s: nothing mapped before the first allocation", k)
		v, err := NewUvector[byte](3<<20, DefaultStream, nil)
		require.NoError(t, err)
		require.GreaterOrEqual(t, pool.PoolSize(), 3<<20)
		require.Less(t, pool.PoolSize(), 1<<30, "Pool: %s: grew by what the request needed, not to the maximum", k)
		require.NoError(t, v.Close())
	}
	require.NoError(t, Reinitialize(nil))
}

func TestReinitializeManagedAndDevices(t *testing.T) {
	reinitIsolate(t)
	require.NoError(t, Reinitialize(&ReinitializeOptions{ManagedMemory: true}))
	mr := CurrentDeviceResource()
	if CUDAAvailable() == nil {
		_, ok := mr.(*ManagedMemoryResource)
		require.True(t, ok, "got %T", mr)
	} else {
		require.Equal(t, HostAccessible, AccessOf(mr), "host memory without CUDA")
	}
	// No devices: the previous set-up is taken off and a warning logged.
	logs := captureDebugLog(t)
	require.NoError(t, Reinitialize(&ReinitializeOptions{Devices: []Device{}}))
	warned := false
	for _, r := range logs.all() {
		warned = warned || r["msg"] == "rmm: Reinitialize called with no devices: no resource was set up"
	}
	require.True(t, warned)
	_, isManaged := CurrentDeviceResource().(*ManagedMemoryResource)
	require.False(t, isManaged)
}

func TestReinitializeLogging(t *testing.T) {
	reinitIsolate(t)
	dir := t.TempDir()
	name := filepath.Join(dir, "rmm_log.csv")
	require.NoError(t, Reinitialize(&ReinitializeOptions{PoolAllocator: true, InitialPoolSize: 1 << 20, Logging: true, LogFileName: name}))
	want := filepath.Join(dir, "rmm_log.dev0.csv")
	require.Equal(t, map[Device]string{0: want}, LogFileNames())
	lg, ok := CurrentDeviceResource().(*LoggingResourceAdaptor)
	require.True(t, ok, "got %T", CurrentDeviceResource())
	pool, ok := lg.Upstream().(*PoolMemoryResource)
	require.True(t, ok)
	if pool.Expandable() {
		// Rounded up to the device's granularity (2 MiB on current GPUs), or over host memory
		// to the least memfd a stitching pool makes within its share of the open-file limit.
		require.GreaterOrEqual(t, pool.PoolSize(), 1<<20)
		require.LessOrEqual(t, pool.PoolSize(), max(2<<20, pool.expandable().fdPiece))
	} else {
		require.Equal(t, 1<<20, pool.PoolSize())
	}

	v, err := NewUvector[int64](100, DefaultStream, nil)
	require.NoError(t, err)
	require.NoError(t, v.Close())

	// Reinitializing without logging closes the log (flushed) and the pool.
	require.NoError(t, Reinitialize(nil))
	require.Empty(t, LogFileNames())
	events, err := ReadLogFile(want)
	require.NoError(t, err)
	require.Len(t, events, 2)
	assert.Equal(t, ActionAllocate, events[0].Action)
	assert.Equal(t, 800, events[0].Size)
	assert.Equal(t, ActionFree, events[1].Action)
	assert.Equal(t, events[0].Pointer, events[1].Pointer)
	_, err = pool.Allocate(256, DefaultStream)
	require.ErrorIs(t, err, ErrClosed)

	// The file name from the environment.
	t.Setenv("RMM_LOG_FILE", filepath.Join(dir, "env.log"))
	require.NoError(t, Reinitialize(&ReinitializeOptions{Logging: true}))
	require.Equal(t, map[Device]string{0: filepath.Join(dir, "env.dev0.log")}, LogFileNames())
	lg2 := CurrentDeviceResource().(*LoggingResourceAdaptor)
	require.Equal(t, AccessOf(initialResource(0)), AccessOf(lg2), "plain base resource under the log")
	_, isPool := lg2.Upstream().(*PoolMemoryResource)
	require.False(t, isPool)

	// A log file that cannot be created: an error, and the device keeps its initial resource.
	err = Reinitialize(&ReinitializeOptions{Logging: true, LogFileName: filepath.Join(dir, "missing", "x.csv")})
	require.Error(t, err)
	require.Contains(t, err.Error(), "device 0")
	_, isLog := CurrentDeviceResource().(*LoggingResourceAdaptor)
	require.False(t, isLog)
	require.Empty(t, LogFileNames())
}

func TestEnableDisableLogging(t *testing.T) {
	reinitIsolate(t)
	dir := t.TempDir()
	t.Setenv("RMM_LOG_FILE", "")
	user := newTestResource()
	_, err := SetPerDeviceResource(0, user)
	require.NoError(t, err)

	require.ErrorIs(t, EnableLogging(""), ErrInvalidArgument, "no name and no RMM_LOG_FILE")
	require.Equal(t, user, CurrentDeviceResource(), "nothing changed")

	require.NoError(t, EnableLogging(filepath.Join(dir, "log.csv")))
	want := filepath.Join(dir, "log.dev0.csv")
	require.Equal(t, want, LogFileNames()[0])
	lg, ok := CurrentDeviceResource().(*LoggingResourceAdaptor)
	require.True(t, ok)
	require.Equal(t, MemoryResource(user), lg.Upstream())
	// Enabling again leaves the logging resource alone.
	require.NoError(t, EnableLogging(filepath.Join(dir, "other.csv")))
	require.Equal(t, MemoryResource(lg), CurrentDeviceResource())

	b, err := NewDeviceBuffer(300, DefaultStream, nil)
	require.NoError(t, err)
	require.NoError(t, b.Close())

	require.NoError(t, DisableLogging())
	require.Equal(t, MemoryResource(user), CurrentDeviceResource())
	require.NotContains(t, LogFileNames(), Device(0))
	events, err := ReadLogFile(want)
	require.NoError(t, err)
	require.Len(t, events, 2)
	assert.Equal(t, 300, events[0].Size)
	assert.Equal(t, ActionFree, events[1].Action)
	allocs, frees, live := user.counts()
	assert.Equal(t, []int{1, 1, 0}, []int{allocs, frees, live})
	require.NoError(t, DisableLogging(), "nothing to disable")

	// A Reinitialize after EnableLogging unwraps the program's resource before setting up.
	require.NoError(t, EnableLogging(filepath.Join(dir, "again.csv")))
	require.NoError(t, Reinitialize(&ReinitializeOptions{Devices: []Device{}}))
	require.Equal(t, MemoryResource(user), CurrentDeviceResource())
	_, err = os.Stat(filepath.Join(dir, "again.dev0.csv"))
	require.NoError(t, err)

	// DisableLogging flushes, but does not close, an adaptor the program made itself.
	mine, err := NewLoggingResourceAdaptorFile(user, filepath.Join(dir, "mine.csv"), nil)
	require.NoError(t, err)
	defer mine.Close()
	_, err = SetPerDeviceResource(0, mine)
	require.NoError(t, err)
	require.Equal(t, filepath.Join(dir, "mine.csv"), LogFileNames()[0])
	require.NoError(t, DisableLogging())
	require.Equal(t, MemoryResource(user), CurrentDeviceResource())
	p, err := mine.Allocate(256, DefaultStream)
	require.NoError(t, err, "still open")
	require.NoError(t, mine.Deallocate(p, 256, DefaultStream))
}

// Logging below a statistics adaptor is still found, flushed, and not silently left on.
func TestLoggingBelowStatistics(t *testing.T) {
	dir := t.TempDir()
	prev := CurrentDeviceResource()
	defer SetCurrentDeviceResource(prev)
	require.NoError(t, Reinitialize(&ReinitializeOptions{PoolAllocator: true, InitialPoolSize: 1 << 20, Logging: true, LogFileName: dir + "/stacked.csv"}))
	defer Reinitialize(nil)
	EnableStatistics()
	names := LogFileNames()
	require.Equal(t, dir+"/stacked.dev0.csv", names[CurrentDevice()])
	v, err := NewUvector[float32](10, DefaultStream, nil)
	require.NoError(t, err)
	require.NoError(t, v.Close())
	require.NoError(t, FlushLogs())
	events, err := ReadLogFile(names[CurrentDevice()])
	require.NoError(t, err)
	require.Len(t, events, 2, "an allocate and a free, readable after FlushLogs")
	require.NoError(t, EnableLogging(dir+"/again.csv"), "already logging: nothing added")
	_, stacked := CurrentDeviceResource().(*StatisticsResourceAdaptor)
	require.True(t, stacked)
	require.ErrorIs(t, DisableLogging(), ErrNotSupported)
}

func TestReinitializeAutoFlush(t *testing.T) {
	dir := t.TempDir()
	prev := CurrentDeviceResource()
	defer SetCurrentDeviceResource(prev)
	require.ErrorIs(t, Reinitialize(&ReinitializeOptions{AutoFlush: true}), ErrInvalidArgument)
	require.NoError(t, Reinitialize(&ReinitializeOptions{Logging: true, LogFileName: dir + "/auto.csv", AutoFlush: true}))
	defer Reinitialize(nil)
	p, err := CurrentDeviceResource().Allocate(1000, DefaultStream)
	require.NoError(t, err)
	events, err := ReadLogFile(LogFileNames()[CurrentDevice()])
	require.NoError(t, err)
	require.Len(t, events, 1, "readable at once")
	require.NoError(t, CurrentDeviceResource().Deallocate(p, 1000, DefaultStream))
}

// A failed Reinitialize after EnableStatistics wrapped the previous pool leaves the device a
// working resource, not a statistics adaptor over a closed pool.
func TestReinitializeUnderStatisticsFails(t *testing.T) {
	prev := CurrentDeviceResource()
	defer SetCurrentDeviceResource(prev)
	require.NoError(t, Reinitialize(&ReinitializeOptions{PoolAllocator: true, InitialPoolSize: 1 << 20}))
	defer Reinitialize(nil)
	EnableStatistics()
	err := Reinitialize(&ReinitializeOptions{PoolAllocator: true, InitialPoolSize: 1 << 60})
	require.ErrorIs(t, err, ErrOutOfMemory)
	p, err := CurrentDeviceResource().Allocate(1000, DefaultStream)
	require.NoError(t, err, "the device has a working resource")
	require.NoError(t, CurrentDeviceResource().Deallocate(p, 1000, DefaultStream))
	require.NoError(t, Reinitialize(&ReinitializeOptions{PoolAllocator: true, InitialPoolSize: 1 << 20}))
	EnableStatistics()
	require.NoError(t, Reinitialize(&ReinitializeOptions{Devices: []Device{}}))
	p, err = CurrentDeviceResource().Allocate(1000, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, CurrentDeviceResource().Deallocate(p, 1000, DefaultStream))
}

// Pool: PlainPool keeps librmm's pool where an expandable one could be had; ExpandablePool gives
// the expandable pool without stitching where the memory allows it.
func TestReinitializePoolKinds(t *testing.T) {
	reinitIsolate(t)
	expandableHere := hostVMMSupported
	if CUDAAvailable() == nil {
		expandableHere = vmmSupported(CurrentDevice())
	}
	for _, k := range []PoolKind{StitchingPool, ExpandablePool, PlainPool} {
		require.NoError(t, Reinitialize(&ReinitializeOptions{PoolAllocator: true, Pool: k, InitialPoolSize: 2 << 20}))
		pool, ok := CurrentDeviceResource().(*PoolMemoryResource)
		require.True(t, ok, "got %T", CurrentDeviceResource())
		want := k
		if !expandableHere {
			want = PlainPool
		}
		require.Equal(t, want, pool.Kind(), "Pool: %s", k)
		v, err := NewUvector[int64](1000, DefaultStream, nil)
		require.NoError(t, err)
		require.NoError(t, v.Close())
	}
	err := Reinitialize(&ReinitializeOptions{PoolAllocator: true, Pool: PoolKind(7)})
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorContains(t, err, "PoolKind(7)")
	require.ErrorIs(t, Reinitialize(&ReinitializeOptions{Pool: ExpandablePool}), ErrInvalidArgument, "Pool without PoolAllocator")

	require.NoError(t, Reinitialize(&ReinitializeOptions{PoolAllocator: true, Pool: PlainPool, InitialPoolSize: 2 << 20}))
	pool, ok := CurrentDeviceResource().(*PoolMemoryResource)
	require.True(t, ok, "got %T", CurrentDeviceResource())
	require.False(t, pool.Expandable())
	require.Equal(t, 2<<20, pool.PoolSize())
	require.Equal(t, 1, pool.Stats().UpstreamBlocks, "one block from the base resource")
	require.NoError(t, Reinitialize(nil))
}
