package rmm

import (
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// LoggingOptions configures a [LoggingResourceAdaptor]. nil means the defaults.
type LoggingOptions struct {
	// AutoFlush writes every line through to the underlying writer or file as it is logged.
	// Default false: lines are kept in a 64 KiB buffer until it fills, or Flush or Close is
	// called.
	AutoFlush bool
}

// LoggingResourceAdaptor forwards every call to its upstream and writes one line of RMM's CSV
// event log per event, byte-compatible with librmm's logging_resource_adaptor, so that its logs
// replay with librmm's replay benchmark and [ReadLog] reads librmm's logs (the format is described
// at [LogHeader] and [LogWriter]):
//
//   - Allocate calls the upstream first and then logs "allocate" with the pointer it returned
//     and the size asked for (unrounded; a zero-byte allocation logs a null pointer "(nil)" and
//     size 0). When the upstream fails it logs "allocate failure" with a null pointer and the size
//     asked for, and returns the upstream's error unchanged.
//   - Deallocate logs "free" first and then calls the upstream.
//
// The Thread column is the OS thread id of the caller (gettid on Linux, 0 elsewhere), the Time
// column the local wall-clock time of day when the line is written, the Stream column the
// stream's CUstream handle (0 for [DefaultStream]; a host stream, which has no handle, logs its
// [StreamView.ID], so that a log made without CUDA replays with its streams apart). A call on a
// view of a Stream that was closed logs 0: its handle was destroyed and may already name another stream,
// and the resources treat a free there as one on DefaultStream. The view itself is handed to the
// upstream as it is.
//
// It is safe for concurrent use: lines are formatted and written under one mutex, so they never
// interleave and appear in the order the events were logged. An error writing the log does not
// fail Allocate or Deallocate (the memory calls have happened); it is kept, reported once in the
// debug log, and returned by Flush and Close. Two adaptors must not write to one file.
type LoggingResourceAdaptor struct {
	upstream  MemoryResource
	autoFlush bool
	file      *os.File // opened by NewLoggingResourceAdaptorFile, closed by Close
	closed    atomic.Bool

	mu       sync.Mutex
	lw       *LogWriter
	reported bool // a write error has gone to the debug log
}

// NewLoggingResourceAdaptor returns an adaptor that logs every event of upstream to w, and writes
// the header line ([LogHeader]) at once (into its buffer unless [LoggingOptions.AutoFlush]); nil
// opts means the defaults. A nil w returns an error wrapping [ErrInvalidArgument]; with AutoFlush,
// w's error writing the header is returned. Close flushes the log but does not close w. A nil
// upstream means the current device resource ([CurrentDeviceResource], read once, here); a nil
// pointer as upstream returns an error wrapping [ErrInvalidArgument].
func NewLoggingResourceAdaptor(upstream MemoryResource, w io.Writer, opts *LoggingOptions) (*LoggingResourceAdaptor, error) {
	upstream, err := upstreamOf("NewLoggingResourceAdaptor", upstream)
	if err != nil {
		return nil, err
	}
	if w == nil {
		return nil, errorf("NewLoggingResourceAdaptor: nil writer: %w", ErrInvalidArgument)
	}
	r := &LoggingResourceAdaptor{upstream: upstream, lw: NewLogWriter(w)}
	if opts != nil {
		r.autoFlush = opts.AutoFlush
	}
	if r.autoFlush {
		if err := r.lw.Flush(); err != nil {
			return nil, errorf("NewLoggingResourceAdaptor: writing the log header: %w", err)
		}
	}
	return r, nil
}

// NewLoggingResourceAdaptorFile returns an adaptor that logs every event of upstream to the file
// at path, which is created or truncated. An empty path means the file named by the RMM_LOG_FILE
// environment variable; when that is empty or unset too, the error wraps [ErrInvalidArgument];
// the operating system's error creating the file is returned as it is (errors.Is(err,
// fs.ErrPermission)). Close flushes and closes the file. A nil upstream means the current device
// resource ([CurrentDeviceResource], read once, here); a nil pointer as upstream returns an error
// wrapping [ErrInvalidArgument], before the file is created.
func NewLoggingResourceAdaptorFile(upstream MemoryResource, path string, opts *LoggingOptions) (*LoggingResourceAdaptor, error) {
	upstream, err := upstreamOf("NewLoggingResourceAdaptorFile", upstream)
	if err != nil {
		return nil, err
	}
	if path == "" {
		path = os.Getenv("RMM_LOG_FILE")
		if path == "" {
			return nil, errorf("NewLoggingResourceAdaptorFile: no file name given and RMM_LOG_FILE is not set: %w", ErrInvalidArgument)
		}
	}
	f, err := os.Create(path)
	if err != nil { // a *fs.PathError naming the file
		return nil, errorf("NewLoggingResourceAdaptorFile: %w", err)
	}
	r, err := NewLoggingResourceAdaptor(upstream, f, opts)
	if err != nil {
		f.Close()
		return nil, err
	}
	r.file = f
	return r, nil
}

// Allocate allocates nbytes from the upstream on stream s and logs the result (see the type's
// comment). A negative size returns an error wrapping [ErrInvalidArgument] without calling the
// upstream or logging (the log format has no negative sizes). After Close it returns an error
// wrapping [ErrClosed].
func (r *LoggingResourceAdaptor) Allocate(nbytes int, s StreamView) (DevicePtr, error) {
	if nbytes < 0 {
		return 0, invalidSize("LoggingResourceAdaptor", "Allocate", nbytes)
	}
	if r.closed.Load() {
		return 0, errorf("LoggingResourceAdaptor.Allocate: the adaptor is closed: %w", ErrClosed)
	}
	p, err := r.upstream.Allocate(nbytes, s)
	if err != nil {
		r.log(ActionAllocateFailure, 0, nbytes, s)
		return 0, err
	}
	r.log(ActionAllocate, p, nbytes, s)
	return p, nil
}

// Deallocate logs the free of p (nbytes, stream s) and then returns p to the upstream,
// returning the upstream's error. A negative size returns an error wrapping [ErrInvalidArgument]
// without calling the upstream or logging. After Close the call still goes to the upstream, so
// that memory can be given back, but is not logged.
func (r *LoggingResourceAdaptor) Deallocate(p DevicePtr, nbytes int, s StreamView) error {
	if nbytes < 0 {
		return invalidSize("LoggingResourceAdaptor", "Deallocate", nbytes)
	}
	r.log(ActionFree, p, nbytes, s)
	return r.upstream.Deallocate(p, nbytes, s)
}

// log writes one line. The thread id (a system call) is taken before the lock, the time under it,
// so that times never go backwards down the file (unless the wall clock itself does).
func (r *LoggingResourceAdaptor) log(a EventAction, p DevicePtr, nbytes int, s StreamView) {
	tid := osThreadID()
	h := s.Handle()
	switch {
	case s.closed():
		h = 0 // destroyed: the value may now be another stream's
	case h == 0 && s.id != 0:
		// A host stream has no CUstream handle; its ID keeps it apart from the others, so that
		// the log replays with the streams it was made on.
		h = uintptr(s.id)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed.Load() {
		return
	}
	e := LogEvent{Thread: tid, Time: timeOfDay(time.Now()), Action: a, Pointer: p, Size: nbytes, Stream: h}
	r.lw.buf = appendLogLine(r.lw.buf[:0], e)
	_, err := r.lw.w.Write(r.lw.buf)
	if err == nil && r.autoFlush {
		err = r.lw.w.Flush()
	}
	if err != nil && !r.reported {
		r.reported = true
		DebugLogger().Error("rmm: LoggingResourceAdaptor: cannot write the event log; later events are lost", "err", err)
	}
}

// Flush writes buffered lines to the underlying writer or file. It returns the first error met
// writing the log, if any.
func (r *LoggingResourceAdaptor) Flush() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lw.Flush()
}

// Close flushes the log and closes its file when [NewLoggingResourceAdaptorFile] opened it (a
// writer given to [NewLoggingResourceAdaptor] is left open). Afterwards Allocate returns [ErrClosed]
// and Deallocate still reaches the upstream, unlogged. Closing again returns nil.
func (r *LoggingResourceAdaptor) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed.Swap(true) {
		return nil
	}
	err := r.lw.Flush()
	if r.file != nil {
		if cerr := r.file.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		return errorf("LoggingResourceAdaptor.Close: %w", err)
	}
	return nil
}

// FileName returns the name of the file the adaptor writes (RMM's get_file_name): the path given
// to [NewLoggingResourceAdaptorFile] (or RMM_LOG_FILE's), "" for an adaptor over a writer.
func (r *LoggingResourceAdaptor) FileName() string {
	if r.file == nil {
		return ""
	}
	return r.file.Name()
}

// Upstream returns the resource the adaptor forwards to.
func (r *LoggingResourceAdaptor) Upstream() MemoryResource { return r.upstream }

func (*LoggingResourceAdaptor) insideUpstream() {}

func (*LoggingResourceAdaptor) passesPointersThrough() {}

// Access reports the upstream's accessibility ([AccessOf](Upstream())).
func (r *LoggingResourceAdaptor) Access() Access { return AccessOf(r.upstream) }

// Device returns the upstream's device ([DeviceOf](Upstream())).
func (r *LoggingResourceAdaptor) Device() Device { return DeviceOf(r.upstream) }
