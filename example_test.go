package rmm_test

import (
	"errors"
	"fmt"
	"log"

	"github.com/gormm/rmm"
)

// The main path: a pool over the GPU (host memory where there is none) as the current device
// resource, then a 1,000,000-element vector allocated from it, filled on its stream and copied
// back.
func Example() {
	pool, err := rmm.NewPoolMemoryResource(rmm.CurrentDeviceResource(), &rmm.PoolOptions{InitialPoolSize: 64 << 20})
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	prev := rmm.SetCurrentDeviceResource(pool)
	defer rmm.SetCurrentDeviceResource(prev)

	stream, err := rmm.NewStream(rmm.CurrentDevice(), &rmm.StreamOptions{NonBlocking: true})
	if err != nil {
		log.Fatal(err)
	}
	defer stream.Close()
	s := stream.View()

	v, err := rmm.NewUvector[float32](1_000_000, s, nil) // nil: the current device resource, the pool
	if err != nil {
		log.Fatal(err)
	}
	if err := v.Fill(0.5, s); err != nil {
		log.Fatal(err)
	}
	host, err := v.ToSlice(s)
	if err != nil {
		log.Fatal(err)
	}
	var sum float64
	for _, x := range host {
		sum += float64(x)
	}
	fmt.Println(len(host), sum)
	if err := v.Close(); err != nil { // back to the pool, ordered on s
		log.Fatal(err)
	}
	st := pool.Stats()
	fmt.Println(st.PoolSize, st.LiveAllocations)
	// Output:
	// 1000000 500000
	// 67108864 0
}

// The README's first program: the default pool (a stitching expandable pool) over the current
// device (host memory where there is no GPU), a vector of 2^20 float32 filled on the GPU and read
// back.
func Example_firstProgram() {
	pool, err := rmm.NewPoolMemoryResource(nil, &rmm.PoolOptions{Expandable: true, Stitch: true})
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	v, err := rmm.NewUvector[float32](1<<20, rmm.DefaultStream, pool) // 4 MiB of device memory
	if err != nil {
		log.Fatal(err)
	}
	defer v.Close()
	if err := v.Fill(0.5, rmm.DefaultStream); err != nil { // a kernel, ordered on the stream
		log.Fatal(err)
	}
	host, err := v.ToSlice(rmm.DefaultStream) // a copy to the host, complete on return
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(len(host), host[0], pool.Stats().LiveBytes)
	// Output: 1048576 0.5 4194304
}

// Replaying an RMM event log against a pool over an address-only upstream: how large the pool
// grows for a real workload, on any machine.
func ExampleReplay() {
	events, err := rmm.ReadLogFile("testdata/traces/cupy_fft_linalg_2threads.csv.gz")
	if err != nil {
		log.Fatal(err)
	}
	sim, _ := rmm.NewSimulatedMemoryResource(16 << 30)
	pool, _ := rmm.NewPoolMemoryResource(sim, nil)
	r, err := rmm.Replay(events, pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(r.Events, r.Failures, r.PeakLiveBytes, pool.PoolSize())
	// Output:
	// 110156 0 618135910 1579564032
}

// Out of memory is an error that says what was asked; the pool keeps working.
func ExamplePoolMemoryResource_outOfMemory() {
	sim, _ := rmm.NewSimulatedMemoryResource(1 << 30)
	pool, _ := rmm.NewPoolMemoryResource(sim, &rmm.PoolOptions{MaximumPoolSize: 1 << 20})
	_, err := pool.Allocate(2<<20, rmm.DefaultStream)
	fmt.Println(err)
	var oom *rmm.OutOfMemoryError
	if errors.As(err, &oom) {
		fmt.Println(oom.Requested, oom.PoolSize, oom.MaximumSize, oom.Fragmented)
	}
	p, err := pool.Allocate(4096, rmm.DefaultStream)
	fmt.Println(err, pool.Deallocate(p, 4096, rmm.DefaultStream))
	// Output:
	// rmm: PoolMemoryResource.Allocate: failed to allocate 2097152 bytes (2 MiB): the request exceeds the maximum pool size; 0 bytes free, largest free block 0 bytes; pool size 0, maximum 1048576 (1 MiB): out of memory
	// 2097152 0 1048576 false
	// <nil> <nil>
}

// Sizes written as RMM's Python API takes them.
func ExampleParseBytes() {
	for _, s := range []string{"4GiB", "512MiB", "1.5GB", "1073741824"} {
		n, err := rmm.ParseBytes(s)
		fmt.Println(s, n, err)
	}
	_, err := rmm.ParseBytes("lots")
	fmt.Println(errors.Is(err, rmm.ErrInvalidArgument))
	// Output:
	// 4GiB 4294967296 <nil>
	// 512MiB 536870912 <nil>
	// 1.5GB 1500000000 <nil>
	// 1073741824 1073741824 <nil>
	// true
}
