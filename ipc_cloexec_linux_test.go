//go:build linux

package rmm

import (
	"errors"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// A child process started after the package obtained descriptors (exports from the driver, the
// host stitching pool's memfds, descriptors received with a handle) holds none of them.

// childFDs starts a child (cat, which opens nothing until it reads) and returns the descriptors
// it holds above 2: exactly those it inherited, under the numbers they have here.
func childFDs(t *testing.T) []int {
	t.Helper()
	cmd := exec.Command("cat")
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start()) // returns once the child has exec'd
	defer func() {
		in.Close()
		cmd.Wait()
	}()
	es, err := os.ReadDir("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/fd")
	require.NoError(t, err)
	var fds []int
	for _, e := range es {
		fd, err := strconv.Atoi(e.Name())
		require.NoError(t, err)
		if fd > 2 {
			fds = append(fds, fd)
		}
	}
	return fds
}

// requireNotInherited checks that a child started now inherits none of fds.
func requireNotInherited(t *testing.T, what string, fds []int) {
	t.Helper()
	require.NotEmpty(t, fds, "%s: no descriptor to check", what)
	inherited := childFDs(t)
	for _, fd := range fds {
		require.NotContains(t, inherited, fd, "%s: descriptor %d passed to a child process (inherited: %v)", what, fd, inherited)
	}
}

// The check itself: a descriptor without close-on-exec is seen in the child.
func TestChildFDsSeesInherited(t *testing.T) {
	syscall.ForkLock.RLock()
	fd, err := syscall.Dup(0) // dup's copy is not close-on-exec
	syscall.ForkLock.RUnlock()
	require.NoError(t, err)
	defer syscall.Close(fd)
	require.Contains(t, childFDs(t), fd)
}

func TestHostDescriptorsNotInherited(t *testing.T) {
	// A stitching pool over host memory holds one memfd per piece.
	p, err := NewPoolMemoryResource(NewSystemMemoryResource(), &PoolOptions{Expandable: true, Stitch: true, MaximumPoolSize: 1 << 30})
	require.NoError(t, err)
	defer func() { require.NoError(t, p.Close()) }()
	ptr, err := p.Allocate(8<<20, DefaultStream)
	require.NoError(t, err)
	defer func() { require.NoError(t, p.Deallocate(ptr, 8<<20, DefaultStream)) }()
	es, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	var memfds []int
	for _, e := range es {
		if link, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.Contains(link, "memfd:rmm-hostvmm") {
			fd, _ := strconv.Atoi(e.Name())
			memfds = append(memfds, fd)
		}
	}
	requireNotInherited(t, "the stitching pool's memfds", memfds)

	// Descriptors that arrive with a handle.
	a, b := ipcSocketPair(t)
	h := memfdHandle(t, ipcTestSmall)
	require.NoError(t, SendIPCHandle(a, h))
	require.NoError(t, h.Close())
	r, err := ReceiveIPCHandle(b)
	require.NoError(t, err)
	defer r.Close()
	requireNotInherited(t, "received descriptors", slices.Clone(r.FDs()))
}

func TestGPUExportedDescriptorsNotInherited(t *testing.T) {
	requireGPU(t)
	t.Run("expandable", func(t *testing.T) {
		p, err := NewPoolMemoryResource(nil, &PoolOptions{Expandable: true, Exportable: true, MaximumPoolSize: 1 << 30})
		if err != nil && errors.Is(err, ErrNotSupported) {
			t.Skip(err)
		}
		require.NoError(t, err)
		defer func() { require.NoError(t, p.Close()) }()
		ptr, err := p.Allocate(4<<20, DefaultStream)
		require.NoError(t, err)
		defer func() { require.NoError(t, p.Deallocate(ptr, 4<<20, DefaultStream)) }()
		h, err := p.ExportIPC(ptr, 4<<20)
		require.NoError(t, err)
		defer h.Close()
		requireNotInherited(t, "the expandable pool's export", h.FDs())
	})
	t.Run("async", func(t *testing.T) {
		a, err := NewCudaAsyncMemoryResource(0, &CudaAsyncOptions{EnablePOSIXFileDescriptor: true})
		if err != nil && errors.Is(err, ErrNotSupported) {
			t.Skip(err)
		}
		require.NoError(t, err)
		defer func() { require.NoError(t, a.Close()) }()
		ptr, err := a.Allocate(1<<20, DefaultStream)
		require.NoError(t, err)
		defer func() { require.NoError(t, a.Deallocate(ptr, 1<<20, DefaultStream)) }()
		h, err := a.ExportIPC(ptr, 1<<20)
		require.NoError(t, err)
		defer h.Close()
		requireNotInherited(t, "the async resource's export", h.FDs())
	})
}
