package rmm

import (
	"io"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
)

// The debug log: where the package reports what is not an error of the call at hand — pool
// growth failures, containers reclaimed without Close (leaks), invalid frees. It is RMM's debug
// logger done with log/slog: set RMM_DEBUG_LOG_FILE to a path to write text records there (the
// file is truncated), and RMM_DEBUG_LOG_LEVEL to debug, info, warn or error (default info). With
// no file it is discarded. SetDebugLogger replaces it.
var debugLogger atomic.Pointer[slog.Logger]

func init() {
	debugLogger.Store(newEnvDebugLogger())
}

func newEnvDebugLogger() *slog.Logger {
	path := os.Getenv("RMM_DEBUG_LOG_FILE")
	if path == "" {
		return slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelError + 100}))
	}
	level := slog.LevelInfo
	switch strings.ToLower(os.Getenv("RMM_DEBUG_LOG_LEVEL")) {
	case "trace", "debug":
		level = slog.LevelDebug
	case "warn", "warning":
		level = slog.LevelWarn
	case "error", "critical":
		level = slog.LevelError
	}
	f, err := os.Create(path)
	if err != nil {
		h := slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})
		l := slog.New(h)
		l.Warn("rmm: cannot open RMM_DEBUG_LOG_FILE, logging to stderr", "path", path, "err", err)
		return l
	}
	return slog.New(slog.NewTextHandler(f, &slog.HandlerOptions{Level: level}))
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
