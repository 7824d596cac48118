package rmm_test

import (
	"errors"
	"fmt"
	"log"

	"github.com/gormm/rmm"
)

// An arena of 64 MiB over the current device resource: small requests come from the stream's
// own arena, large ones from the global arena; freeing everything and defragmenting (Release)
// leaves one free block of the whole arena.
func ExampleArenaMemoryResource() {
	arena, err := rmm.NewArenaMemoryResource(nil, &rmm.ArenaOptions{ArenaSize: 64 << 20})
	if err != nil {
		log.Fatal(err)
	}
	defer arena.Close()
	stream, err := rmm.NewStream(rmm.CurrentDevice(), nil)
	if err != nil {
		log.Fatal(err)
	}
	defer stream.Close()
	s := stream.View()

	small, _ := arena.Allocate(1000, s)  // ≤ 1 MiB: the stream's arena
	large, _ := arena.Allocate(8<<20, s) // > 1 MiB: the global arena
	_, err = arena.Allocate(128<<20, s)  // more than the arena
	fmt.Println(errors.Is(err, rmm.ErrOutOfMemory))
	st := arena.Stats()
	fmt.Println(st.LiveAllocations, st.LiveBytes, st.StreamArenas)

	arena.Deallocate(small, 1000, s)
	arena.Deallocate(large, 8<<20, s)
	arena.Release()
	st = arena.Stats()
	fmt.Println(st.FreeBytes == st.ArenaSize, st.Superblocks, st.LargestFreeBlock)
	// Output:
	// true
	// 2 8389632 1
	// true 1 67108864
}

// A fixed-size resource of 64 KiB blocks, 4 per chunk: every request up to the block size takes
// a whole block; a fifth block takes a second chunk; larger requests are refused.
func ExampleFixedSizeMemoryResource() {
	fixed, err := rmm.NewFixedSizeMemoryResource(nil, &rmm.FixedSizeOptions{BlockSize: 64 << 10, BlocksToPreallocate: 4})
	if err != nil {
		log.Fatal(err)
	}
	defer fixed.Close()
	var ptrs []rmm.DevicePtr
	for i := 0; i < 5; i++ {
		p, err := fixed.Allocate(100+i, rmm.DefaultStream)
		if err != nil {
			log.Fatal(err)
		}
		ptrs = append(ptrs, p)
	}
	st := fixed.Stats()
	fmt.Println(st.LiveAllocations, st.LiveBytes, st.UpstreamBlocks, st.FreeBlocks)
	_, err = fixed.Allocate(64<<10+1, rmm.DefaultStream)
	fmt.Println(err)
	for i, p := range ptrs {
		fixed.Deallocate(p, 100+i, rmm.DefaultStream)
	}
	fixed.Release() // both chunks are wholly free again
	fmt.Println(fixed.Stats().PoolSize)
	// Output:
	// 5 327680 2 3
	// rmm: FixedSizeMemoryResource.Allocate: failed to allocate 65537 bytes (64.001 KiB): maximum allocation size exceeded: every block is 65536 bytes, and larger requests always fail; 196608 bytes (192 KiB) free, largest free block 65536 bytes (64 KiB); pool size 524288 (512 KiB), no maximum: out of memory
	// 0
}

// Binning: fixed-size bins of 1, 2 and 4 KiB; each request goes to the smallest bin that holds
// it, larger ones to the upstream. AddBin adds a bin later, also while other goroutines allocate.
func ExampleBinningMemoryResource() {
	binning, err := rmm.NewBinningMemoryResource(nil, &rmm.BinningOptions{MinSizeExponent: 10, MaxSizeExponent: 12})
	if err != nil {
		log.Fatal(err)
	}
	defer binning.Close()
	if err := binning.AddBin(64<<10, nil); err != nil {
		log.Fatal(err)
	}
	var sizes []int
	for _, b := range binning.Bins() {
		sizes = append(sizes, b.Size)
	}
	fmt.Println(sizes)
	for _, n := range []int{1, 1500, 4096, 60000, 2 << 20} {
		p, err := binning.Allocate(n, rmm.DefaultStream)
		if err != nil {
			log.Fatal(err)
		}
		if err := binning.Deallocate(p, n, rmm.DefaultStream); err != nil {
			log.Fatal(err)
		}
	}
	fmt.Println(binning.CheckInvariants())
	// Output:
	// [1024 2048 4096 65536]
	// <nil>
}
