package rmm_test

import (
	"fmt"
	"log"

	"github.com/gormm/rmm"
)

// Count the memory allocated through a resource, and measure a block of code on its own with a
// level of counters pushed before it and popped after it.
func ExampleStatisticsResourceAdaptor() {
	stats, err := rmm.NewStatisticsResourceAdaptor(nil) // over the current device resource
	if err != nil {
		log.Fatal(err)
	}
	a, _ := stats.Allocate(1000, rmm.DefaultStream)
	b, _ := stats.Allocate(3000, rmm.DefaultStream)
	_ = stats.Deallocate(a, 1000, rmm.DefaultStream)
	fmt.Printf("%+v\n", stats.Stats())

	stats.PushCounters() // measure what follows on its own
	c, _ := stats.Allocate(500, rmm.DefaultStream)
	_ = stats.Deallocate(b, 3000, rmm.DefaultStream) // allocated before the push: goes negative
	block, _ := stats.PopCounters()
	fmt.Printf("%+v\n", block)

	_ = stats.Deallocate(c, 500, rmm.DefaultStream)
	fmt.Printf("%+v\n", stats.Stats()) // the popped level is folded back in
	_, err = stats.PopCounters()
	fmt.Println(err)
	// Output:
	// current 3000 bytes in 1, peak 4000 bytes in 2, total 4000 bytes in 2
	// current -2500 bytes in 0, peak 500 bytes in 1, total 500 bytes in 1
	// current 0 bytes in 0, peak 4000 bytes in 2, total 4500 bytes in 3
	// rmm: StatisticsResourceAdaptor.PopCounters: cannot pop the last level of counters: index out of range
}

// The statistics of a block of code through the current device resource, as Python's
// rmm.statistics.statistics() context.
func ExampleWithStatistics() {
	st, err := rmm.WithStatistics(func() {
		mr := rmm.CurrentDeviceResource() // a StatisticsResourceAdaptor while f runs
		p, _ := mr.Allocate(1<<20, rmm.DefaultStream)
		q, _ := mr.Allocate(1<<20, rmm.DefaultStream)
		_ = mr.Deallocate(p, 1<<20, rmm.DefaultStream)
		_ = mr.Deallocate(q, 1<<20, rmm.DefaultStream)
	})
	fmt.Println(st.PeakBytes, st.TotalCount, err)
	_, enabled := rmm.GetStatistics() // the previous resource is back
	fmt.Println(enabled)
	// Output:
	// 2097152 2 <nil>
	// false
}

// Cap the memory a resource hands out.
func ExampleLimitingResourceAdaptor() {
	lim, err := rmm.NewLimitingResourceAdaptor(nil, 1<<20, nil) // 1 MiB over the current device resource
	if err != nil {
		log.Fatal(err)
	}
	p, _ := lim.Allocate(700_000, rmm.DefaultStream)
	fmt.Println(lim.AllocatedBytes(), lim.AllocationLimit()) // charged in multiples of 256 bytes
	_, err = lim.Allocate(500_000, rmm.DefaultStream)
	fmt.Println(err)
	_ = lim.Deallocate(p, 700_000, rmm.DefaultStream)
	q, err := lim.Allocate(500_000, rmm.DefaultStream) // fits now
	fmt.Println(lim.AllocatedBytes(), err)
	_ = lim.Deallocate(q, 500_000, rmm.DefaultStream)
	// Output:
	// 700160 1048576
	// rmm: LimitingResourceAdaptor.Allocate (limit 1048576, allocated 700160): failed to allocate 500000 bytes (488.281 KiB): exceeded memory limit: out of memory
	// 500224 <nil>
}

// Find what was never freed. (Over an address-only resource, so that the addresses printed are
// the same on every machine.)
func ExampleTrackingResourceAdaptor() {
	sim, _ := rmm.NewSimulatedMemoryResource(1 << 30)
	tr, err := rmm.NewTrackingResourceAdaptor(sim, nil) // &rmm.TrackingOptions{CaptureStacks: true} records who allocated
	if err != nil {
		log.Fatal(err)
	}
	a, _ := tr.Allocate(4096, rmm.DefaultStream)
	_, _ = tr.Allocate(100, rmm.DefaultStream) // leaked
	_, _ = tr.Allocate(1<<20, rmm.DefaultStream)
	_ = tr.Deallocate(a, 4096, rmm.DefaultStream)
	fmt.Println(tr.AllocatedBytes(), len(tr.OutstandingAllocations()))
	fmt.Print(tr.OutstandingAllocationsString())
	// Output:
	// 1048676 2
	// 0x10000000001000: 100 B
	// 0x10000000001100: 1048576 B
}

// Profile the device memory of named blocks of code and print the report.
func ExampleProfiler() {
	prev := rmm.CurrentDeviceResource()
	defer rmm.SetCurrentDeviceResource(prev)
	rmm.EnableStatistics() // the profiler measures through the current device resource

	prof := rmm.NewProfiler()
	mr := rmm.CurrentDeviceResource()
	load := func() {
		for range 3 {
			p, _ := mr.Allocate(4<<20, rmm.DefaultStream)
			defer mr.Deallocate(p, 4<<20, rmm.DefaultStream)
		}
	}
	step := func() {
		defer prof.Start("step")() // a block of code rather than a function
		p, _ := mr.Allocate(1000, rmm.DefaultStream)
		_ = mr.Deallocate(p, 1000, rmm.DefaultStream)
	}
	_ = prof.Profile("load", load)
	for range 1500 {
		step()
	}
	report, _ := prof.Report("memory_peak")
	fmt.Println(report)
	// Output:
	// Memory Profiling
	// ================
	//
	// Legends:
	//   ncalls       - number of times the function or code block was called
	//   memory_peak  - peak memory allocated in function or code block (in bytes)
	//   memory_total - total memory allocated in function or code block (in bytes)
	//
	// Ordered by: memory_peak
	//
	// ncalls     memory_peak    memory_total  filename:lineno(function)
	//      1      12,582,912      12,582,912  load
	//  1,500           1,000       1,500,000  step
}

// Spill on demand: when the memory runs out, free something and try again.
func ExampleFailureCallbackResourceAdaptor() {
	sim, _ := rmm.NewSimulatedMemoryResource(1 << 20) // 1 MiB
	cache, _ := sim.Allocate(768<<10, rmm.DefaultStream)
	spilled := false
	mr, err := rmm.NewFailureCallbackResourceAdaptor(sim, func(nbytes int, err error) bool {
		if spilled {
			return false // nothing left to spill: give up
		}
		fmt.Printf("allocating %d bytes failed; spilling the cache\n", nbytes)
		spilled = sim.Deallocate(cache, 768<<10, rmm.DefaultStream) == nil
		return spilled // true: try again
	}, nil)
	if err != nil {
		log.Fatal(err)
	}
	p, err := mr.Allocate(512<<10, rmm.DefaultStream)
	fmt.Println(p != 0, err)
	_, err = mr.Allocate(1<<20, rmm.DefaultStream)
	fmt.Println(err != nil)
	// Output:
	// allocating 524288 bytes failed; spilling the cache
	// true <nil>
	// true
}

// See which stream's work holds the memory: each allocation is charged to the stream it was made
// on, until it is freed (on whichever stream).
func ExampleStreamStatisticsResourceAdaptor() {
	sim, _ := rmm.NewSimulatedMemoryResource(1 << 30)
	byStream, err := rmm.NewStreamStatisticsResourceAdaptor(sim)
	if err != nil {
		log.Fatal(err)
	}
	copies, _ := rmm.NewStream(rmm.CurrentDevice(), nil)
	defer copies.Close()
	compute, _ := rmm.NewStream(rmm.CurrentDevice(), nil)
	defer compute.Close()

	in, _ := byStream.Allocate(64<<20, copies.View())
	a, _ := byStream.Allocate(8<<20, compute.View())
	b, _ := byStream.Allocate(8<<20, compute.View())
	_ = byStream.Deallocate(a, 8<<20, compute.View())
	for _, st := range byStream.ByStream() {
		fmt.Printf("current %d, peak %d, allocations %d\n", st.CurrentBytes, st.PeakBytes, st.TotalCount)
	}
	// Handed to compute (after an Event, on a GPU) and freed there: still taken off copies.
	_ = byStream.Deallocate(in, 64<<20, compute.View())
	fmt.Println(byStream.StreamStats(copies.View()).CurrentBytes, byStream.StreamStats(compute.View()).CurrentBytes)
	_ = byStream.Deallocate(b, 8<<20, compute.View())
	// Output:
	// current 67108864, peak 67108864, allocations 1
	// current 8388608, peak 16777216, allocations 2
	// 0 8388608
}
