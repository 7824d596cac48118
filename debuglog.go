package rmm

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"math"
	"os"
	"strings"
	"sync"
	"sync/atomic"
)

// The debug log: where the package reports what is not an error of the call at hand — containers
// reclaimed without Close (leaks, at Warn), a pool closed with live allocations (Warn), pool
// growth (Debug) and growth that failed (Debug). It is RMM's debug logger done with log/slog:
//
//   - RMM_DEBUG_LOG_FILE: where to write text records. A path (the file is truncated), or
//     "stderr" / "-" for standard error. Default: standard error.
//   - RMM_DEBUG_LOG_LEVEL: trace, debug, info, warn (or warning), error, critical, off.
//     Default: warn. An unknown value is reported once and warn is used.
//
// SetDebugLogLevel and SetDebugLogFlushLevel change the package's own logger at run time
// (RMM's set_logging_level and set_flush_level), FlushDebugLog writes out what it holds
// (flush_logger); SetDebugLogger replaces the logger, e.g. with one that discards or one of the
// program's own.
var debugLogger atomic.Pointer[slog.Logger]

// RMM's seven log levels as slog levels: slog's four, and these three.
const (
	// LevelTrace is below slog.LevelDebug: RMM's trace.
	LevelTrace slog.Level = slog.LevelDebug - 4
	// LevelCritical is above slog.LevelError: RMM's critical.
	LevelCritical slog.Level = slog.LevelError + 4
	// LevelOff is above every level: nothing is written.
	LevelOff slog.Level = math.MaxInt32
)

var (
	debugLevel      slog.LevelVar // the package logger's level
	debugFlushLevel slog.LevelVar // its records at or above this level are flushed at once
)

func init() {
	debugLogger.Store(newEnvDebugLogger())
}

// debugWriter is where the package's own logger writes: a file, buffered (flushed by records at
// or above the flush level, by FlushDebugLog and at every level change), or standard error,
// written through at once.
type debugWriter struct {
	mu  sync.Mutex
	buf *bufio.Writer // nil: w is written directly
	w   io.Writer
}

func (d *debugWriter) Write(p []byte) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.buf == nil {
		return d.w.Write(p)
	}
	return d.buf.Write(p)
}

func (d *debugWriter) flush() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.buf == nil {
		return nil
	}
	return d.buf.Flush()
}

// flushingHandler flushes its writer after each record at or above the flush level.
type flushingHandler struct {
	slog.Handler
	out *debugWriter
}

func (h flushingHandler) Handle(ctx context.Context, r slog.Record) error {
	err := h.Handler.Handle(ctx, r)
	if r.Level >= debugFlushLevel.Level() {
		if ferr := h.out.flush(); err == nil {
			err = ferr
		}
	}
	return err
}

func (h flushingHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return flushingHandler{h.Handler.WithAttrs(as), h.out}
}

func (h flushingHandler) WithGroup(name string) slog.Handler {
	return flushingHandler{h.Handler.WithGroup(name), h.out}
}

// levelName writes LevelTrace and LevelCritical by RMM's names rather than slog's DEBUG-4 and
// ERROR+4.
func levelName(_ []string, a slog.Attr) slog.Attr {
	if a.Key == slog.LevelKey {
		if l, ok := a.Value.Any().(slog.Level); ok {
			switch l {
			case LevelTrace:
				a.Value = slog.StringValue("TRACE")
			case LevelCritical:
				a.Value = slog.StringValue("CRITICAL")
			}
		}
	}
	return a
}

// parseLevel reads one of RMM's level names.
func parseLevel(v string) (slog.Level, bool) {
	switch strings.ToLower(v) {
	case "trace":
		return LevelTrace, true
	case "debug":
		return slog.LevelDebug, true
	case "info":
		return slog.LevelInfo, true
	case "warn", "warning":
		return slog.LevelWarn, true
	case "error", "err":
		return slog.LevelError, true
	case "critical":
		return LevelCritical, true
	case "off":
		return LevelOff, true
	}
	return 0, false
}

func newEnvDebugLogger() *slog.Logger {
	var problems []any
	level := slog.LevelWarn
	if v := os.Getenv("RMM_DEBUG_LOG_LEVEL"); v != "" {
		if l, ok := parseLevel(v); ok {
			level = l
		} else {
			problems = append(problems, "RMM_DEBUG_LOG_LEVEL", v, "valid", "trace, debug, info, warn, error, critical, off")
		}
	}
	out := &debugWriter{w: os.Stderr}
	switch path := os.Getenv("RMM_DEBUG_LOG_FILE"); path {
	case "", "stderr", "-":
	default:
		f, err := os.Create(path)
		if err != nil {
			problems = append(problems, "RMM_DEBUG_LOG_FILE", path, "err", err)
		} else {
			out = &debugWriter{w: f, buf: bufio.NewWriter(f)}
		}
	}
	debugLevel.Set(level)
	// Every record is written through by default: Go has no exit hook to flush a buffer, and a
	// program that ends without FlushDebugLog would lose what waited there.
	debugFlushLevel.Set(LevelTrace)
	l := slog.New(flushingHandler{slog.NewTextHandler(out, &slog.HandlerOptions{Level: &debugLevel, ReplaceAttr: levelName}), out})
	if len(problems) > 0 {
		slog.New(slog.NewTextHandler(os.Stderr, nil)).Warn("rmm: ignoring a debug log setting", problems...)
	}
	return l
}

// DebugLogger returns the package's debug logger.
func DebugLogger() *slog.Logger { return debugLogger.Load() }

// SetDebugLogger replaces the debug logger and returns the previous one; nil restores the one
// configured by RMM_DEBUG_LOG_FILE and RMM_DEBUG_LOG_LEVEL (a new one: the file is truncated, the
// levels are those of the environment again). The levels set by [SetDebugLogLevel] and
// [SetDebugLogFlushLevel] are the package's own logger's: a logger set here filters by its own
// handler.
func SetDebugLogger(l *slog.Logger) *slog.Logger {
	if l == nil {
		l = newEnvDebugLogger()
	}
	old := debugLogger.Swap(l)
	flushOf(old)
	return old
}

// DebugLogLevel returns the level of the package's own debug logger (RMM's get_logging_level):
// records below it are not written. Default: slog.LevelWarn, or RMM_DEBUG_LOG_LEVEL.
func DebugLogLevel() slog.Level { return debugLevel.Level() }

// SetDebugLogLevel sets the level of the package's own debug logger and returns the previous
// one (RMM's set_logging_level): [LevelTrace], slog.LevelDebug, slog.LevelInfo, slog.LevelWarn,
// slog.LevelError, [LevelCritical], [LevelOff], or any slog level between. It takes effect at once,
// for every goroutine; records already buffered are flushed first.
func SetDebugLogLevel(l slog.Level) slog.Level {
	FlushDebugLog()
	prev := debugLevel.Level()
	debugLevel.Set(l)
	return prev
}

// DebugLogFlushLevel returns the level at or above which the package's own debug logger flushes
// its file after each record (RMM's get_flush_level). Default: [LevelTrace], so every record is
// written at once (Go has no exit hook that would flush a buffer). Records written to standard
// error are never held back.
func DebugLogFlushLevel() slog.Level { return debugFlushLevel.Level() }

// SetDebugLogFlushLevel sets the flush level (RMM's set_flush_level) and returns the previous
// one. Below it, records written to a file wait in a buffer until a record at or above it,
// [FlushDebugLog], a level change or the logger's replacement; a program that raises it must call
// FlushDebugLog before it exits, or lose what waits.
func SetDebugLogFlushLevel(l slog.Level) slog.Level {
	prev := debugFlushLevel.Level()
	debugFlushLevel.Set(l)
	return prev
}

// FlushDebugLog writes out what the package's own debug logger holds in its buffer (RMM's
// flush_logger) and returns the write's error, if any; a logger set with [SetDebugLogger] is left
// to its own handler.
func FlushDebugLog() error { return flushOf(DebugLogger()) }

// flushOf flushes l's buffer when l is one of the package's own loggers.
func flushOf(l *slog.Logger) error {
	if h, ok := l.Handler().(flushingHandler); ok {
		return h.out.flush()
	}
	return nil
}
