package rmm_test

import (
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/gormm/rmm"
)

// A host vector in pinned memory: its copies to and from device vectors are queued on a stream
// and return at once; reading it waits for them.
func ExampleHostVector() {
	s := rmm.DefaultStream
	h, err := rmm.NewHostVector[int32](8, nil) // pinned memory (plain host memory without a GPU)
	if err != nil {
		log.Fatal(err)
	}
	defer h.Close()
	hs, err := h.Slice()
	if err != nil {
		log.Fatal(err)
	}
	for i := range hs {
		hs[i] = int32(i * i)
	}

	d, err := rmm.NewUvector[int32](8, s, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer d.Close()
	if err := h.CopyToDeviceAsync(d, s); err != nil { // returns while the copy runs
		log.Fatal(err)
	}
	if err := d.SetElement(0, -1, s); err != nil { // ordered after the copy on s
		log.Fatal(err)
	}

	back, err := rmm.NewHostVector[int32](8, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer back.Close()
	if err := back.CopyFromDeviceAsync(d, s); err != nil {
		log.Fatal(err)
	}
	// ... other host work here, while the copy runs ...
	out, err := back.Slice() // waits for the copy
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(out)
	// Output:
	// [-1 1 4 9 16 25 36 49]
}

// Setting up device 0 in one call, as Python's rmm.reinitialize: a 64 MiB pool with an event log
// per device. Reinitialize(nil) then goes back to the plain resource, which closes the pool and
// the log.
func ExampleReinitialize() {
	dir, err := os.MkdirTemp("", "rmm-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	err = rmm.Reinitialize(&rmm.ReinitializeOptions{
		PoolAllocator:   true,
		InitialPoolSize: 64 << 20,
		Logging:         true,
		LogFileName:     filepath.Join(dir, "rmm_log.csv"),
	})
	if err != nil {
		log.Fatal(err)
	}
	logger := rmm.CurrentDeviceResource().(*rmm.LoggingResourceAdaptor)
	pool := logger.Upstream().(*rmm.PoolMemoryResource)
	fmt.Println(filepath.Base(rmm.LogFileNames()[0]), pool.PoolSize())

	v, err := rmm.NewUvector[float64](500, rmm.DefaultStream, nil) // from the logged pool
	if err != nil {
		log.Fatal(err)
	}
	if err := v.Close(); err != nil {
		log.Fatal(err)
	}

	if err := rmm.Reinitialize(nil); err != nil {
		log.Fatal(err)
	}
	events, err := rmm.ReadLogFile(filepath.Join(dir, "rmm_log.dev0.csv"))
	if err != nil {
		log.Fatal(err)
	}
	for _, e := range events {
		fmt.Println(e.Action, e.Size)
	}
	fmt.Println(len(rmm.LogFileNames()))
	// Output:
	// rmm_log.dev0.csv 67108864
	// allocate 4000
	// free 4000
	// 0
}

// A pool over pinned host memory: containers from it live in host memory that the GPU uses
// directly. As a host resource, pinned memory takes any power-of-two alignment.
func ExamplePinnedMemoryResource() {
	pinned, err := rmm.NewPinnedMemoryResource(0)
	if err != nil {
		log.Fatal(err)
	}
	pool, err := rmm.NewPoolMemoryResource(pinned, &rmm.PoolOptions{InitialPoolSize: 1 << 20})
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	s := rmm.DefaultStream
	v, err := rmm.NewUvector[uint8](4096, s, pool)
	if err != nil {
		log.Fatal(err)
	}
	defer v.Close()
	if err := v.Fill(7, s); err != nil {
		log.Fatal(err)
	}
	last, err := v.Back(s)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(last, rmm.AccessOf(pool)&rmm.HostAccessible != 0, pool.PoolSize())

	p, err := pinned.AllocateHost(100, 4096)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(uintptr(p) % 4096)
	if err := pinned.DeallocateHost(p, 100, 4096); err != nil {
		log.Fatal(err)
	}
	// Output:
	// 7 true 1048576
	// 0
}

// A resource whose allocations are done by the program's own functions, here counting calls
// around the current device resource.
func ExampleCallbackMemoryResource() {
	base := rmm.CurrentDeviceResource()
	calls := 0
	mr, err := rmm.NewCallbackMemoryResource(
		func(n int, s rmm.StreamView) (rmm.DevicePtr, error) {
			calls++
			return base.Allocate(n, s)
		},
		func(p rmm.DevicePtr, n int, s rmm.StreamView) error {
			calls++
			return base.Deallocate(p, n, s)
		},
		&rmm.CallbackOptions{Access: rmm.AccessOf(base)},
	)
	if err != nil {
		log.Fatal(err)
	}
	s := rmm.DefaultStream
	v, err := rmm.NewUvector[float64](1000, s, mr)
	if err != nil {
		log.Fatal(err)
	}
	if err := v.Fill(1.5, s); err != nil {
		log.Fatal(err)
	}
	x, err := v.Element(999, s)
	if err != nil {
		log.Fatal(err)
	}
	if err := v.Close(); err != nil {
		log.Fatal(err)
	}
	fmt.Println(x, calls)
	// Output:
	// 1.5 2
}
