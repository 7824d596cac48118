package rmm

import (
	"io"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
)

// The debug log: where the package reports what is not an error of the call at hand — containers
// reclaimed without Close (leaks, at Warn), a pool closed with live allocations (Warn), pool
// growth that failed (Debug). It is RMM's debug logger done with log/slog:
//
//   - RMM_DEBUG_LOG_FILE: where to write text records. A path (the file is truncated), or
//     "stderr" / "-" for standard error. Default: standard error.
//   - RMM_DEBUG_LOG_LEVEL: trace or debug, info, warn (or warning), error (or critical), off.
//     Default: warn. An unknown value is reported once and warn is used.
//
// SetDebugLogger replaces the logger, e.g. with one that discards or one of the program's own.
var debugLogger atomic.Pointer[slog.Logger]

func init() {
	debugLogger.Store(newEnvDebugLogger())
}

func newEnvDebugLogger() *slog.Logger {
	var w io.Writer = os.Stderr
	var problems []any
	level := slog.LevelWarn
	switch v := strings.ToLower(os.Getenv("RMM_DEBUG_LOG_LEVEL")); v {
	case "":
	case "trace", "debug":
		level = slog.LevelDebug
	case "info":
		level = slog.LevelInfo
	case "warn", "warning":
		level = slog.LevelWarn
	case "error", "critical":
		level = slog.LevelError
	case "off":
		return slog.New(slog.DiscardHandler)
	default:
		problems = append(problems, "RMM_DEBUG_LOG_LEVEL", v)
	}
	switch path := os.Getenv("RMM_DEBUG_LOG_FILE"); path {
	case "", "stderr", "-":
	default:
		f, err := os.Create(path)
		if err != nil {
			problems = append(problems, "RMM_DEBUG_LOG_FILE", path, "err", err)
		} else {
			w = f
		}
	}
	l := slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level}))
	if len(problems) > 0 {
		slog.New(slog.NewTextHandler(os.Stderr, nil)).Warn("rmm: ignoring a debug log setting", problems...)
	}
	return l
}

// DebugLogger returns the package's debug logger.
func DebugLogger() *slog.Logger { return debugLogger.Load() }

// SetDebugLogger replaces the debug logger and returns the previous one; nil restores the one
// configured by RMM_DEBUG_LOG_FILE and RMM_DEBUG_LOG_LEVEL.
func SetDebugLogger(l *slog.Logger) *slog.Logger {
	if l == nil {
		l = newEnvDebugLogger()
	}
	return debugLogger.Swap(l)
}
