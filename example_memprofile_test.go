package rmm_test

import (
	"bytes"
	"fmt"
	"log"

	"github.com/google/pprof/profile"
	"github.com/gormm/rmm"
)

// Where did the memory go: record the call stacks of allocations and read them as Go's heap
// profile. At rate 1 every allocation is recorded and the figures are exact; the default rate
// samples (DefaultMemoryProfileRate). A program serving net/http/pprof also mounts
//
//	http.Handle("/debug/pprof/devicemem", rmm.MemoryProfileHandler(prof.MemoryProfile))
//
// and reads it with go tool pprof http://localhost:6060/debug/pprof/devicemem.
func ExampleMemoryProfileResourceAdaptor() {
	prof, err := rmm.NewMemoryProfileResourceAdaptor(rmm.NewSystemMemoryResource(), &rmm.MemoryProfileOptions{Rate: 1})
	if err != nil {
		log.Fatal(err)
	}
	s := rmm.DefaultStream
	var weights []rmm.DevicePtr
	for range 3 {
		p, _ := prof.Allocate(4<<20, s) // one call site: one sample
		weights = append(weights, p)
	}
	scratch, _ := prof.Allocate(1<<20, s) // another
	_ = prof.Deallocate(scratch, 1<<20, s)

	var buf bytes.Buffer
	if err := prof.WriteProfile(&buf); err != nil { // what MemoryProfileHandler serves
		log.Fatal(err)
	}
	p, err := profile.Parse(&buf)
	if err != nil {
		log.Fatal(err)
	}
	var inuse int64
	for _, s := range p.Sample {
		inuse += s.Value[3] // inuse_space
	}
	fmt.Println(len(p.Sample), "samples,", inuse, "bytes in use")

	sites, _ := prof.TopSites(1, "inuse_space")
	fmt.Println(sites[0].Function, sites[0].InUseObjects, sites[0].InUseBytes, sites[0].AllocBytes)

	for _, w := range weights {
		_ = prof.Deallocate(w, 4<<20, s)
	}
	// Output:
	// 2 samples, 12582912 bytes in use
	// github.com/gormm/rmm_test.ExampleMemoryProfileResourceAdaptor 3 12582912 12582912
}
