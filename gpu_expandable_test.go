package rmm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// The expandable pool over the device's virtual memory.

func gpuDeviceVMMCase(t *testing.T) []expVMMCase {
	requireGPU(t)
	vm, err := newDeviceVMM(0)
	require.NoError(t, err)
	g := vm.granularity()
	return []expVMMCase{{"device", g, func(t *testing.T) vmm {
		vm, err := newDeviceVMM(0)
		require.NoError(t, err)
		return vm
	}}}
}

func TestGPUExpandablePoolReachesItsCap(t *testing.T) {
	runExpCases(t, gpuDeviceVMMCase(t), expCaseReachesCap)
}

func TestGPUExpandablePoolCoalescesAcrossStreams(t *testing.T) {
	runExpCases(t, gpuDeviceVMMCase(t), expCaseCoalescesAcrossStreams)
}

func TestGPUExpandablePoolCoalescesAcrossGrowthSteps(t *testing.T) {
	runExpCases(t, gpuDeviceVMMCase(t), expCaseCoalescesAcrossGrowthSteps)
}

func TestGPUExpandablePoolReleaseKeepsOnlyLiveChunks(t *testing.T) {
	runExpCases(t, gpuDeviceVMMCase(t), expCaseReleaseKeepsOnlyLiveChunks)
}

func TestGPUExpandablePoolOutOfMemoryFigures(t *testing.T) {
	runExpCases(t, gpuDeviceVMMCase(t), expCaseOutOfMemoryFigures)
}

// A block that spans the seams between chunks of separate growth steps holds what is written
// into it, end to end.
func TestGPUExpandablePoolSpansChunks(t *testing.T) {
	requireGPU(t)
	cuda, _ := NewCudaMemoryResource(0)
	p, err := NewPoolMemoryResource(cuda, &PoolOptions{Expandable: true, MaximumPoolSize: 1 << 30})
	require.NoError(t, err)
	defer p.Close()
	ctx, _ := Device(0).ctx()
	var ptrs []DevicePtr
	for range 3 {
		x, err := p.Allocate(40<<20, DefaultStream)
		require.NoError(t, err)
		ptrs = append(ptrs, x)
	}
	require.Equal(t, 3, p.Stats().UpstreamBlocks, "one chunk per growth")
	for _, x := range ptrs {
		require.NoError(t, p.Deallocate(x, 40<<20, DefaultStream))
	}
	const n = 120 << 20
	y, err := p.Allocate(n, DefaultStream)
	require.NoError(t, err)
	require.Equal(t, ptrs[0], y)
	require.Equal(t, 3, p.Stats().UpstreamBlocks, "no growth")
	require.NoError(t, deviceFill(0, y, n, le64(0x0b0b0b0b0b0b0b0b), DefaultStream))
	checkAll(t, ctx, y, n, 0x0b)
	require.NoError(t, p.Deallocate(y, n, DefaultStream))
}

// A block freed on a stream whose kernels are still running, then Release: the pool waits for
// the stream before it unmaps the chunk (an early unmap would be an illegal address and kill the
// context), the kernels' result is intact, and the memory goes back to the device.
func TestGPUExpandablePoolReleaseWhileKernelRuns(t *testing.T) {
	requireGPU(t)
	cuda, _ := NewCudaMemoryResource(0)
	const n = 256 << 20
	p, err := NewPoolMemoryResource(cuda, &PoolOptions{Expandable: true, MaximumPoolSize: 4 << 30})
	require.NoError(t, err)
	defer p.Close()
	a, _ := NewStream(0, &StreamOptions{NonBlocking: true})
	defer a.Close()
	ctx, _ := Device(0).ctx()
	result, err := cuda.Allocate(n, DefaultStream)
	require.NoError(t, err)
	defer cuda.Deallocate(result, n, DefaultStream)
	for round := 0; round < 3; round++ {
		x, err := p.Allocate(n, a.View())
		require.NoError(t, err)
		gpuBusyThenCopy(t, ctx, x, n, result, a.View())
		require.NoError(t, p.Deallocate(x, n, a.View()))
		freeBefore, _, err := Device(0).MemoryInfo()
		require.NoError(t, err)
		require.NoError(t, p.Release())
		require.Zero(t, p.PoolSize())
		freeAfter, _, err := Device(0).MemoryInfo()
		require.NoError(t, err)
		require.GreaterOrEqual(t, freeAfter-freeBefore, n, "the chunk's memory went back to the device")
		require.NoError(t, a.Synchronize())
		require.NoError(t, cuCtxSynchronize(ctx))
		checkAll(t, ctx, result, n, 0x07)
	}
	require.NoError(t, p.CheckInvariants())
}

// ReleaseThreshold over the device: frees past the threshold give memory back.
func TestGPUExpandablePoolReleaseThreshold(t *testing.T) {
	requireGPU(t)
	cuda, _ := NewCudaMemoryResource(0)
	p, err := NewPoolMemoryResource(cuda, &PoolOptions{Expandable: true, MaximumPoolSize: 4 << 30, ReleaseThreshold: 64 << 20})
	require.NoError(t, err)
	defer p.Close()
	var ptrs []DevicePtr
	for range 8 {
		x, err := p.Allocate(128<<20, DefaultStream)
		require.NoError(t, err)
		require.NoError(t, deviceFill(0, x, 128<<20, []byte{9}, DefaultStream))
		ptrs = append(ptrs, x)
	}
	for _, x := range ptrs {
		require.NoError(t, p.Deallocate(x, 128<<20, DefaultStream))
	}
	st := p.Stats()
	require.LessOrEqual(t, st.FreeBytes, 64<<20+expandableMinChunk)
	require.NoError(t, p.CheckInvariants())
	ctx, _ := Device(0).ctx()
	require.NoError(t, cuCtxSynchronize(ctx))
}
