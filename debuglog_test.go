package rmm

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// envDebugLog points the package's own debug logger at a new file with the given level from the
// environment, and restores the logger and levels the test found when it ends.
func envDebugLog(t *testing.T, level string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "debug.log")
	t.Setenv("RMM_DEBUG_LOG_FILE", path)
	t.Setenv("RMM_DEBUG_LOG_LEVEL", level)
	lv, flv := DebugLogLevel(), DebugLogFlushLevel()
	prev := SetDebugLogger(nil)
	t.Cleanup(func() {
		SetDebugLogger(prev)
		debugLevel.Set(lv)
		debugFlushLevel.Set(flv)
	})
	return path
}

func readLog(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return string(b)
}

func TestDebugLogLevelsFromEnvironment(t *testing.T) {
	for name, want := range map[string]slog.Level{
		"trace": LevelTrace, "debug": slog.LevelDebug, "info": slog.LevelInfo, "warning": slog.LevelWarn,
		"error": slog.LevelError, "CRITICAL": LevelCritical, "off": LevelOff, "": slog.LevelWarn,
	} {
		t.Run(name, func(t *testing.T) {
			envDebugLog(t, name)
			require.Equal(t, want, DebugLogLevel())
			require.Equal(t, LevelTrace, DebugLogFlushLevel(), "every record written through")
		})
	}
}

// The level changes at run time; trace and critical records carry RMM's names.
func TestDebugLogSetLevel(t *testing.T) {
	path := envDebugLog(t, "warn")
	ctx := context.Background()
	DebugLogger().Info("dropped at warn")
	require.Equal(t, slog.LevelWarn, SetDebugLogLevel(LevelTrace))
	require.Equal(t, LevelTrace, DebugLogLevel())
	require.True(t, DebugLogger().Enabled(ctx, LevelTrace))
	DebugLogger().Log(ctx, LevelTrace, "a trace record")
	DebugLogger().Log(ctx, LevelCritical, "a critical record")
	require.Equal(t, LevelTrace, SetDebugLogLevel(LevelOff))
	DebugLogger().Log(ctx, LevelCritical, "dropped when off")
	require.NoError(t, FlushDebugLog())
	got := readLog(t, path)
	require.NotContains(t, got, "dropped")
	require.Contains(t, got, `level=TRACE msg="a trace record"`)
	require.Contains(t, got, `level=CRITICAL msg="a critical record"`)
}

// Below the flush level records wait in the file's buffer; a record at or above it, or
// FlushDebugLog, writes them out.
func TestDebugLogFlushLevel(t *testing.T) {
	path := envDebugLog(t, "debug")
	DebugLogger().Debug("written at once by default")
	require.Contains(t, readLog(t, path), "written at once by default")
	require.Equal(t, LevelTrace, SetDebugLogFlushLevel(slog.LevelError))
	DebugLogger().Warn("held back")
	require.NotContains(t, readLog(t, path), "held back")
	DebugLogger().Error("flushes")
	got := readLog(t, path)
	require.Contains(t, got, "held back")
	require.Contains(t, got, "flushes")
	DebugLogger().Info("held back again")
	require.NotContains(t, readLog(t, path), "held back again")
	require.NoError(t, FlushDebugLog())
	require.Contains(t, readLog(t, path), "held back again")
	require.Equal(t, slog.LevelError, SetDebugLogFlushLevel(slog.LevelDebug))
	DebugLogger().Debug("at once")
	require.Contains(t, readLog(t, path), "at once")
}

// Pool growth is logged at debug, plain and expandable, with the bytes taken.
func TestDebugLogPoolGrowth(t *testing.T) {
	path := envDebugLog(t, "debug")
	plain, err := NewPoolMemoryResource(NewSystemMemoryResource(), &PoolOptions{InitialPoolSize: 1 << 20})
	require.NoError(t, err)
	defer plain.Close()
	x, err := plain.Allocate(3<<20, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, plain.Deallocate(x, 3<<20, DefaultStream))
	exp := newExpTestPool(t, newSimVMM(hostVMMGranularity, 0), PoolOptions{MaximumPoolSize: 1 << 30})
	defer exp.Close()
	y, err := exp.Allocate(5<<20, DefaultStream)
	require.NoError(t, err)
	require.NoError(t, exp.Deallocate(y, 5<<20, DefaultStream))
	require.NoError(t, FlushDebugLog())
	got := readLog(t, path)
	require.Contains(t, got, `msg="rmm: PoolMemoryResource grew" request=3145728 bytes=3145728 pool_size=4194304`)
	lines := strings.Split(got, "\n")
	found := false
	for _, l := range lines {
		if strings.Contains(l, `msg="rmm: PoolMemoryResource (expandable) grew"`) && strings.Contains(l, "bytes=33554432") {
			found = true
		}
	}
	require.True(t, found, "the expandable pool's growth of one 32 MiB chunk is logged:\n%s", got)
}
