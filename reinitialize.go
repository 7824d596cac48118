package rmm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
)

// ReinitializeOptions configures [Reinitialize], as the arguments of Python's rmm.reinitialize.
// nil means the defaults: every listed device gets its plain initial resource.
type ReinitializeOptions struct {
	// PoolAllocator puts a [PoolMemoryResource] of the kind Pool names over each device's base
	// resource. Default false.
	PoolAllocator bool
	// Pool is the kind of pool PoolAllocator builds. Default [StitchingPool]. The expandable
	// kinds need the driver's virtual memory management over device memory, or Linux over host
	// memory (no CUDA, where ManagedMemory changes nothing); over managed memory on a GPU, or
	// where the device or the system lacks it, the pool is a [PlainPool]. Over host memory a stitching pool holds an open file descriptor
	// per piece of memory it maps: its pieces are made large enough that it never holds more
	// than half of the process's limit on open files (RLIMIT_NOFILE) at its maximum size.
	Pool PoolKind
	// ManagedMemory makes the base resource a [ManagedMemoryResource] instead of a
	// [CudaMemoryResource]. Default false. Without CUDA the base resource is host memory
	// (a [SystemMemoryResource]) either way.
	ManagedMemory bool
	// InitialPoolSize is the pool's initial size in bytes, a multiple of 256 (an expandable pool
	// rounds it up to the device's granularity, 2 MiB on current GPUs); only with
	// PoolAllocator. Default 0: for a [PlainPool], half of the device's free memory (rounded down
	// to 256 bytes, and at most MaximumPoolSize when that is set), as Python's default (without
	// CUDA the host's available memory stands for the device's free memory); for the expandable
	// kinds nothing: they map memory as the program asks for it.
	InitialPoolSize int
	// MaximumPoolSize caps each pool, in bytes, a multiple of 256 and at least InitialPoolSize;
	// only with PoolAllocator. Default 0: unbounded.
	MaximumPoolSize int
	// Devices are the devices to set up, each at most once. Default nil: device 0. An empty,
	// non-nil slice sets up no device: the resources a previous [Reinitialize] installed are removed
	// and a warning goes to [DebugLogger].
	Devices []Device
	// Logging wraps each device's resource in a [LoggingResourceAdaptor] writing RMM's CSV event log
	// to a file per device (see LogFileName). Default false.
	Logging bool
	// LogFileName is the log file name; only with Logging. Each device's log goes to this name
	// with ".dev<N>" inserted before the extension (what follows the last dot, as Python's
	// os.path.splitext), made absolute: "rmm_log.csv" gives "/current/dir/rmm_log.dev0.csv" for
	// device 0, "noext" gives "noext.dev0", "trace.csv.gz" gives "trace.csv.dev0.gz". The log is
	// plain CSV whatever the name ([ReadLog] reads it either way). Default "": the RMM_LOG_FILE environment
	// variable; with Logging and neither set, [Reinitialize] returns [ErrInvalidArgument].
	LogFileName string
	// AutoFlush flushes each log after every line ([LoggingOptions.AutoFlush]), so that a log can be
	// read while the program runs. Default false: lines are buffered until [FlushLogs],
	// [DisableLogging] or the next [Reinitialize].
	AutoFlush bool
}

var (
	reinitMu sync.Mutex // serialises Reinitialize, EnableLogging, DisableLogging
	// reinitOwned are the resources that Reinitialize and EnableLogging made (pools, logging
	// adaptors, base resources); the next Reinitialize takes them off the devices and closes them.
	reinitOwned = map[MemoryResource]bool{}

	hooksMu     sync.Mutex
	reinitHooks []*reinitHook
)

type reinitHook struct{ f func() }

// RegisterReinitializeHook registers f to be called at the start of every [Reinitialize], before
// any resource is replaced: for instance to free caches that hold memory of the resources about
// to go. Hooks run in the reverse order of registration, on the goroutine calling Reinitialize
// (a hook that calls Reinitialize recurses). The returned function unregisters f (calling it again does
// nothing). A nil f is ignored.
func RegisterReinitializeHook(f func()) (unregister func()) {
	if f == nil {
		return func() {}
	}
	h := &reinitHook{f: f}
	hooksMu.Lock()
	reinitHooks = append(reinitHooks, h)
	hooksMu.Unlock()
	return func() {
		hooksMu.Lock()
		defer hooksMu.Unlock()
		if i := slices.Index(reinitHooks, h); i >= 0 {
			reinitHooks = slices.Delete(reinitHooks, i, i+1)
		}
	}
}

// Reinitialize sets up the memory resources of a list of devices in one call, as Python's
// rmm.reinitialize:
//
//  1. The options are checked first; a bad option returns an error wrapping [ErrInvalidArgument]
//     and changes nothing (no hook runs).
//  2. The hooks ([RegisterReinitializeHook]) run, in reverse registration order.
//  3. The resources a previous Reinitialize or [EnableLogging] installed are taken off their
//     devices (each device gets back what lay under them: its initial resource, or a resource of
//     the program's that EnableLogging had wrapped; adaptors the program put on top of them, such
//     as EnableStatistics', are removed with them) and closed: pools give back their free
//     memory, logs are flushed and their files closed. Memory still allocated from them stays
//     valid and may be freed as usual, but should not be used with the new setup in mind.
//  4. For each device a resource is built: the base is a [CudaMemoryResource] (the device's
//     initial resource), a [ManagedMemoryResource] with ManagedMemory, or host memory without CUDA;
//     with PoolAllocator a [PoolMemoryResource] over it (of the kind Pool names, a stitching pool
//     by default, where its memory can be had); with Logging a [LoggingResourceAdaptor]
//     (file per device, see LogFileName) on top. It is installed with [SetPerDeviceResource].
//
// If building fails for some device (out of memory for the pool, a log file that cannot be
// created), what was built is closed, nothing new is installed (the devices keep what step 3
// left them) and the error is returned. The current device is not changed (resources are built for explicit devices).
// Reinitialize must not run concurrently with allocations on the devices it sets up.
func Reinitialize(opts *ReinitializeOptions) error {
	var o ReinitializeOptions
	if opts != nil {
		o = *opts
	}
	devices, names, err := reinitCheck(&o)
	if err != nil {
		return err
	}
	hooksMu.Lock()
	hooks := slices.Clone(reinitHooks)
	hooksMu.Unlock()
	for i := len(hooks) - 1; i >= 0; i-- {
		hooks[i].f()
	}

	reinitMu.Lock()
	defer reinitMu.Unlock()
	teardownErr := reinitTeardown()
	if len(devices) == 0 {
		DebugLogger().Warn("rmm: Reinitialize called with no devices: no resource was set up")
		return teardownErr
	}

	built := make([]MemoryResource, len(devices))
	var owned []MemoryResource
	fail := func(err error) error {
		for i := len(owned) - 1; i >= 0; i-- {
			closeResource(owned[i])
		}
		return errors.Join(err, teardownErr)
	}
	for i, d := range devices {
		mr, made, err := reinitBuild(d, &o, names[d])
		owned = append(owned, made...)
		if err != nil {
			return fail(errorf("Reinitialize: %s: %w", d, err))
		}
		built[i] = mr
	}
	for i, d := range devices {
		if _, err := SetPerDeviceResource(d, built[i]); err != nil {
			return fail(err) // cannot happen: the devices were checked
		}
	}
	for _, mr := range owned {
		reinitOwned[mr] = true
	}
	return teardownErr
}

// reinitCheck validates the options and returns the devices and, with logging, each device's log
// file name.
func reinitCheck(o *ReinitializeOptions) ([]Device, map[Device]string, error) {
	bad := func(format string, args ...any) error {
		return errorf("Reinitialize: %s: %w", fmt.Sprintf(format, args...), ErrInvalidArgument)
	}
	switch {
	case o.InitialPoolSize < 0 || o.MaximumPoolSize < 0:
		return nil, nil, bad("negative pool size (InitialPoolSize %d, MaximumPoolSize %d)", o.InitialPoolSize, o.MaximumPoolSize)
	case !o.PoolAllocator && (o.InitialPoolSize != 0 || o.MaximumPoolSize != 0):
		return nil, nil, bad("InitialPoolSize %d and MaximumPoolSize %d are only used with PoolAllocator", o.InitialPoolSize, o.MaximumPoolSize)
	case !o.Pool.valid():
		return nil, nil, bad("Pool %s is not a pool kind (StitchingPool, ExpandablePool or PlainPool)", o.Pool)
	case !o.PoolAllocator && o.Pool != StitchingPool:
		return nil, nil, bad("Pool %s is only used with PoolAllocator", o.Pool)
	case o.InitialPoolSize%Alignment != 0:
		return nil, nil, bad("InitialPoolSize %d is not a multiple of %d bytes", o.InitialPoolSize, Alignment)
	case o.MaximumPoolSize%Alignment != 0:
		return nil, nil, bad("MaximumPoolSize %d is not a multiple of %d bytes", o.MaximumPoolSize, Alignment)
	case o.MaximumPoolSize > 0 && o.InitialPoolSize > o.MaximumPoolSize:
		return nil, nil, bad("InitialPoolSize %d exceeds MaximumPoolSize %d", o.InitialPoolSize, o.MaximumPoolSize)
	case !o.Logging && o.LogFileName != "":
		return nil, nil, bad("LogFileName %q is only used with Logging", o.LogFileName)
	case !o.Logging && o.AutoFlush:
		return nil, nil, bad("AutoFlush is only used with Logging")
	}
	devices := o.Devices
	if devices == nil {
		devices = []Device{0}
	}
	seen := map[Device]bool{}
	for _, d := range devices {
		if err := d.check(); err != nil {
			return nil, nil, errorf("Reinitialize: Devices: %w", err)
		}
		if seen[d] {
			return nil, nil, bad("%s is listed twice in Devices", d)
		}
		seen[d] = true
	}
	var names map[Device]string
	if o.Logging {
		names = map[Device]string{}
		for _, d := range devices {
			name, err := deviceLogFileName(o.LogFileName, d)
			if err != nil {
				return nil, nil, errorf("Reinitialize: %w", err)
			}
			names[d] = name
		}
	}
	return devices, names, nil
}

// deviceLogFileName returns the log file of device d for name (RMM_LOG_FILE when empty): the
// absolute path with ".dev<d>" inserted before the extension, as Python's logging adaptor names
// its files. The extension is what follows the last dot of the file's name, unless that dot
// begins the name (".log" has none), as Python's os.path.splitext.
func deviceLogFileName(name string, d Device) (string, error) {
	if name == "" {
		name = os.Getenv("RMM_LOG_FILE")
		if name == "" {
			return "", errorf("logging needs a file name: none given and RMM_LOG_FILE is not set: %w", ErrInvalidArgument)
		}
	}
	abs, err := filepath.Abs(name)
	if err != nil {
		return "", errorf("log file %q: %w: %w", name, err, ErrInvalidArgument)
	}
	dir, base := filepath.Split(abs)
	stem, ext := base, ""
	if i := strings.LastIndexByte(base, '.'); i > 0 && strings.TrimLeft(base[:i], ".") != "" {
		stem, ext = base[:i], base[i:]
	}
	return dir + fmt.Sprintf("%s.dev%d%s", stem, int(d), ext), nil
}

// reinitDefaultPoolSize is half of d's free memory rounded down to 256 bytes, capped by maximum
// when positive.
func reinitDefaultPoolSize(d Device, maximum int) (int, error) {
	free, _, err := d.MemoryInfo()
	if err != nil {
		return 0, err
	}
	n := AlignDown(free/2, Alignment)
	if maximum > 0 && n > maximum {
		n = maximum
	}
	return n, nil
}

// reinitBuild builds device d's resource. made lists what it created (to close on failure),
// innermost first; mr is nil for the device's initial resource.
func reinitBuild(d Device, o *ReinitializeOptions, logName string) (mr MemoryResource, made []MemoryResource, err error) {
	cuda := CUDAAvailable() == nil
	switch {
	case cuda && o.ManagedMemory:
		m, err := NewManagedMemoryResource(d)
		if err != nil {
			return nil, made, err
		}
		mr = m
		made = append(made, m)
	case o.PoolAllocator || o.Logging:
		mr = initialResource(d) // the device's CudaMemoryResource, or host memory
	}
	if o.PoolAllocator {
		po := o.Pool.Options()
		initial := o.InitialPoolSize
		// The kind asked for where its memory can be had: the expandable kinds map device
		// memory themselves (or host memory through memfds), which managed memory and a device
		// without virtual memory management cannot give.
		switch _, overDevice := mr.(*CudaMemoryResource); {
		case cuda && !(overDevice && vmmSupported(d)), !cuda && !hostVMMSupported:
			po = PlainPool.Options()
		}
		// librmm's pool grows by upstream allocations that it never splits back: starting it at
		// half the free memory (Python's default) saves the growths and the fragmentation of
		// their steps. The expandable pools grow by mapping just what a request lacks and give
		// memory back, so taking half the device up front would only hold memory the program
		// may never use (and hide the footprint they are chosen for).
		if initial == 0 && !po.Expandable {
			if initial, err = reinitDefaultPoolSize(d, o.MaximumPoolSize); err != nil {
				return nil, made, errorf("the default initial pool size: %w", err)
			}
		}
		po.InitialPoolSize, po.MaximumPoolSize = initial, o.MaximumPoolSize
		pool, err := NewPoolMemoryResource(mr, &po)
		if err != nil {
			return nil, made, err
		}
		mr = pool
		made = append(made, pool)
	}
	if o.Logging {
		lg, err := NewLoggingResourceAdaptorFile(mr, logName, &LoggingOptions{AutoFlush: o.AutoFlush})
		if err != nil {
			return nil, made, err
		}
		mr = lg
		made = append(made, lg)
	}
	return mr, made, nil
}

// reinitTeardown takes the resources of reinitOwned off every device and closes them.
func reinitTeardown() error {
	if len(reinitOwned) == 0 {
		return nil
	}
	for d, mr := range perDeviceSnapshot() {
		// The first resource Reinitialize made in the device's chain: the device's resource, or
		// one below adaptors the program put on it (EnableStatistics). Those adaptors go with it,
		// since what they wrap is closed below.
		for mr != nil && !reinitOwned[mr] {
			u, ok := mr.(Upstreamer)
			if !ok {
				mr = nil
				break
			}
			mr = u.Upstream()
		}
		if mr == nil {
			continue
		}
		under := mr
		for under != nil && reinitOwned[under] {
			u, ok := under.(Upstreamer)
			if !ok {
				under = nil
				break
			}
			under = u.Upstream()
		}
		if _, err := SetPerDeviceResource(d, under); err != nil {
			return err
		}
	}
	var errs []error
	// Outermost first: logs are flushed before the pools under them close.
	for _, mr := range ownedOutermostFirst() {
		if err := closeResource(mr); err != nil {
			errs = append(errs, errorf("Reinitialize: closing the previous %s: %w", resourceName(mr), err))
		}
	}
	clear(reinitOwned)
	return errors.Join(errs...)
}

// ownedOutermostFirst orders reinitOwned so that an adaptor comes before its upstream.
func ownedOutermostFirst() []MemoryResource {
	depth := func(mr MemoryResource) int {
		n := 0
		for {
			u, ok := mr.(Upstreamer)
			if !ok || !reinitOwned[u.Upstream()] {
				return n
			}
			mr = u.Upstream()
			n++
		}
	}
	out := make([]MemoryResource, 0, len(reinitOwned))
	for mr := range reinitOwned {
		out = append(out, mr)
	}
	slices.SortStableFunc(out, func(a, b MemoryResource) int { return depth(b) - depth(a) })
	return out
}

// closeResource closes mr when it can be closed.
func closeResource(mr MemoryResource) error {
	if c, ok := mr.(interface{ Close() error }); ok {
		return c.Close()
	}
	return nil
}

// perDeviceSnapshot returns the resources recorded for each device now.
func perDeviceSnapshot() map[Device]MemoryResource {
	resMu.RLock()
	defer resMu.RUnlock()
	out := make(map[Device]MemoryResource, len(perDevice))
	for d, mr := range perDevice {
		out[d] = mr
	}
	return out
}

// loggingIn returns the first LoggingResourceAdaptor in mr's chain of upstreams (mr itself, or
// below adaptors such as a StatisticsResourceAdaptor that EnableStatistics put on top), and
// whether it is mr itself.
func loggingIn(mr MemoryResource) (lg *LoggingResourceAdaptor, top bool) {
	for i := 0; mr != nil; i++ {
		if lg, ok := mr.(*LoggingResourceAdaptor); ok {
			return lg, i == 0
		}
		u, ok := mr.(Upstreamer)
		if !ok {
			return nil, false
		}
		mr = u.Upstream()
	}
	return nil, false
}

// LogFileNames returns the log file of every device whose resource logs to a file — a
// [LoggingResourceAdaptor] set up by [Reinitialize], [EnableLogging] or [NewLoggingResourceAdaptorFile],
// as the resource or below other adaptors — as Python's rmm.get_log_filenames: absolute paths for
// the files Reinitialize and EnableLogging create. Devices without a log are absent. Logs are
// buffered unless AutoFlush was asked for: [FlushLogs] writes out what is pending.
func LogFileNames() map[Device]string {
	out := map[Device]string{}
	for d, mr := range perDeviceSnapshot() {
		if lg, _ := loggingIn(mr); lg != nil && lg.FileName() != "" {
			out[d] = lg.FileName()
		}
	}
	return out
}

// FlushLogs flushes every device's [LoggingResourceAdaptor] (found as [LogFileNames] finds them) and
// returns the first error.
func FlushLogs() error {
	var errs []error
	for d, mr := range perDeviceSnapshot() {
		if lg, _ := loggingIn(mr); lg != nil {
			if err := lg.Flush(); err != nil {
				errs = append(errs, errorf("FlushLogs: %s: %w", d, err))
			}
		}
	}
	return errors.Join(errs...)
}

// EnableLogging wraps the resource of every device that has one recorded (set, or looked up since
// the program started), and of the current device, in a [LoggingResourceAdaptor] writing to a file
// per device named as [ReinitializeOptions.LogFileName] describes (fileName "" means RMM_LOG_FILE;
// neither set returns [ErrInvalidArgument]), as Python's rmm.enable_logging. Devices whose resource
// already logs (a LoggingResourceAdaptor as the resource or below it) are left alone. On an error (a file that cannot be created)
// nothing is changed. Allocations made before the call are freed through the old resource and so
// are not logged.
func EnableLogging(fileName string) error {
	reinitMu.Lock()
	defer reinitMu.Unlock()
	if _, err := PerDeviceResource(CurrentDevice()); err != nil {
		return err
	}
	snap := perDeviceSnapshot()
	devs := make([]Device, 0, len(snap))
	for d, mr := range snap {
		if lg, _ := loggingIn(mr); lg == nil {
			devs = append(devs, d)
		}
	}
	slices.Sort(devs)
	var made []*LoggingResourceAdaptor
	for _, d := range devs {
		name, err := deviceLogFileName(fileName, d)
		if err == nil {
			var lg *LoggingResourceAdaptor
			if lg, err = NewLoggingResourceAdaptorFile(snap[d], name, nil); err == nil {
				made = append(made, lg)
				continue
			}
		}
		for _, lg := range made {
			lg.Close()
		}
		return errorf("EnableLogging: %s: %w", d, err)
	}
	for i, d := range devs {
		if _, err := SetPerDeviceResource(d, made[i]); err != nil {
			return err
		}
		reinitOwned[made[i]] = true
	}
	return nil
}

// DisableLogging replaces every device's resource that is a [LoggingResourceAdaptor] by its
// upstream, as Python's rmm.disable_logging. A log below another adaptor ([EnableStatistics] after
// logging) is flushed and reported as an error wrapping [ErrNotSupported], not removed. Adaptors made by [Reinitialize] or [EnableLogging] are
// closed (their logs flushed, their files closed); others are flushed only. Memory allocated
// through an adaptor may still be freed through it: the free reaches the upstream, unlogged once
// it is closed. It returns the first error flushing or closing a log.
func DisableLogging() error {
	reinitMu.Lock()
	defer reinitMu.Unlock()
	var errs []error
	snap := perDeviceSnapshot()
	devs := make([]Device, 0, len(snap))
	for d := range snap {
		devs = append(devs, d)
	}
	slices.Sort(devs)
	for _, d := range devs {
		lg, top := loggingIn(snap[d])
		if lg == nil {
			continue
		}
		if !top {
			// Another adaptor sits on it: unwrapping would drop that adaptor too.
			if err := lg.Flush(); err != nil {
				errs = append(errs, errorf("DisableLogging: %s: %w", d, err))
			}
			errs = append(errs, errorf("DisableLogging: %s: the log is below %s; remove that adaptor first (the log was flushed): %w", d, resourceName(snap[d]), ErrNotSupported))
			continue
		}
		if _, err := SetPerDeviceResource(d, lg.Upstream()); err != nil {
			errs = append(errs, err)
			continue
		}
		var err error
		if reinitOwned[lg] {
			delete(reinitOwned, lg)
			err = lg.Close()
		} else {
			err = lg.Flush()
		}
		if err != nil {
			errs = append(errs, errorf("DisableLogging: %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// vmmSupported reports whether device d supports the driver's virtual memory management (asked of
// the driver once per call; no failing call is made).
func vmmSupported(d Device) bool {
	_, err := newDeviceVMM(d)
	return err == nil
}
