package rmm

import (
	"slices"
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

// gpuFragmentRounds is the scenario of the stitching test below, over the device's
// virtual memory with the pool tuned by tune (8 MiB pieces): sixteen 8 MiB blocks of one growth
// (sixteen handles), half of them freed on stream a behind long kernels that write and read them,
// then a 64 MiB request on stream b that no free block holds. Twice: the odd blocks first, then
// (after they are allocated again on b) the even ones. check gets the request's block y and the
// VMM's counts before the frees and after the request; then every pattern — what the kernels
// copied out, the live blocks, y's fill — must read back intact.
func gpuFragmentRounds(t *testing.T, tune poolTuning, check func(round int, big, y DevicePtr, before, after vmmCounts)) {
	requireGPU(t)
	dv, err := newDeviceVMM(0)
	require.NoError(t, err)
	const piece = 8 * mib
	if dv.granularity() > 2*mib {
		t.Skipf("granularity %d", dv.granularity())
	}
	vm := newCountingVMM(dv)
	p := newTunedTestPool(t, vm, PoolOptions{MaximumPoolSize: 1 << 30}, tune)
	defer p.Close()
	a, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	defer a.Close()
	b, err := NewStream(0, &StreamOptions{NonBlocking: true})
	require.NoError(t, err)
	defer b.Close()
	ctx, _ := Device(0).ctx()
	cuda, _ := NewCudaMemoryResource(0)
	results, err := cuda.Allocate(8*piece, DefaultStream)
	require.NoError(t, err)
	defer cuda.Deallocate(results, 8*piece, DefaultStream)

	big, err := p.Allocate(16*piece, a.View()) // one growth: sixteen handles of 8 MiB
	require.NoError(t, err)
	require.NoError(t, p.Deallocate(big, 16*piece, a.View()))
	require.Equal(t, 16, vm.counts().creates)
	var blk [16]DevicePtr
	for i := range blk {
		blk[i], err = p.Allocate(piece, a.View())
		require.NoError(t, err)
		require.Equal(t, big+DevicePtr(i*piece), blk[i])
		require.NoError(t, deviceFill(0, blk[i], piece, []byte{byte(0x10 + i)}, a.View()))
	}
	for round, freed := range [][]int{{1, 3, 5, 7, 9, 11, 13, 15}, {0, 2, 4, 6, 8, 10, 12, 14}} {
		before := vm.counts()
		for k, i := range freed {
			gpuBusyThenCopy(t, ctx, blk[i], piece, results+DevicePtr(k*piece), a.View())
			require.NoError(t, p.Deallocate(blk[i], piece, a.View()))
		}
		y, err := p.Allocate(8*piece, b.View())
		require.NoError(t, err)
		require.NoError(t, deviceFill(0, y, 8*piece, []byte{0xee + byte(round)}, b.View()))
		check(round, big, y, before, vm.counts())
		require.Equal(t, 16*piece, p.PoolSize(), "round %d", round)
		require.NoError(t, b.Synchronize())
		require.NoError(t, a.Synchronize())
		checkAll(t, ctx, results, 8*piece, 0x07)
		checkAll(t, ctx, y, 8*piece, 0xee+byte(round))
		for i := range blk {
			if !slices.Contains(freed, i) {
				checkAll(t, ctx, blk[i], piece, byte(0x10+i))
			}
		}
		require.NoError(t, p.CheckInvariants())
		// For the second round: y's memory comes back as eight blocks, one for each block
		// freed in the first.
		require.NoError(t, p.Deallocate(y, 8*piece, b.View()))
		if round == 0 {
			for _, i := range freed {
				blk[i], err = p.Allocate(piece, b.View())
				require.NoError(t, err)
				require.NoError(t, deviceFill(0, blk[i], piece, []byte{byte(0x10 + i)}, b.View()))
			}
			require.NoError(t, b.Synchronize())
		}
	}
	require.NoError(t, cuCtxSynchronize(ctx))
	require.NoError(t, p.Release())
	require.NoError(t, p.CheckInvariants())
}

// Stitching while kernels still run over the fragments (gpuFragmentRounds): the pool maps the
// eight freed handles a second time, back to back, in a range of its own (no memory created),
// after b waits for a.
func TestGPUExpandablePoolStitchesWhileKernelRuns(t *testing.T) {
	gpuFragmentRounds(t, poolTuning{stitchPiece: 8 * mib, stitchRest: true}, func(round int, big, y DevicePtr, before, after vmmCounts) {
		require.True(t, y < big || y >= big+16*8*mib, "round %d: the block lies in a range of its own", round)
		require.Equal(t, before.creates, after.creates, "round %d: no new memory", round)
		require.GreaterOrEqual(t, after.maps-before.maps, 8, "round %d: the freed handles mapped again", round)
	})
}

// The stitching state machine test (resource_pool_stitch_property_test.go) over the device's
// virtual memory and real streams: fills queued on the allocations' streams, frees queued behind
// kernels still writing the blocks on the freeing stream, and every filled live block read back
// (through stitched ranges and the chain's addresses under them) at each Verify step.
func TestGPUStitchProperty(t *testing.T) {
	requireGPU(t)
	dv, err := newDeviceVMM(0)
	require.NoError(t, err)
	if dv.granularity() > 2*mib {
		t.Skipf("granularity %d", dv.granularity())
	}
	testStitchProperty(t, "device", 2*mib, true)
}
