package rmm_test

import (
	"bytes"
	"fmt"
	"strings"
	"time"

	"github.com/gormm/rmm"
)

// Log every allocation and free of a resource in RMM's CSV format, then read the log back.
func ExampleLoggingResourceAdaptor() {
	var log bytes.Buffer
	mr, err := rmm.NewLoggingResourceAdaptor(rmm.NewSystemMemoryResource(), &log, nil)
	if err != nil {
		panic(err)
	}
	p, err := mr.Allocate(1000, rmm.DefaultStream)
	if err != nil {
		panic(err)
	}
	q, err := mr.Allocate(0, rmm.DefaultStream) // logged with a null pointer
	if err != nil {
		panic(err)
	}
	if err := mr.Deallocate(p, 1000, rmm.DefaultStream); err != nil {
		panic(err)
	}
	if err := mr.Deallocate(q, 0, rmm.DefaultStream); err != nil {
		panic(err)
	}
	if err := mr.Close(); err != nil { // flushes the log
		panic(err)
	}

	header, _, _ := strings.Cut(log.String(), "\n") // the first line of the log
	fmt.Println(header)
	events, err := rmm.ReadLog(&log)
	if err != nil {
		panic(err)
	}
	for _, e := range events {
		fmt.Printf("line %d: %s %d bytes, null pointer: %v, stream %#x\n", e.Line, e.Action, e.Size, e.Pointer == 0, e.Stream)
	}
	// Output:
	// Thread,Time,Action,Pointer,Size,Stream
	// line 2: allocate 1000 bytes, null pointer: false, stream 0x0
	// line 3: allocate 0 bytes, null pointer: true, stream 0x0
	// line 4: free 1000 bytes, null pointer: false, stream 0x0
	// line 5: free 0 bytes, null pointer: true, stream 0x0
}

// Write events in librmm's exact format, as its replay benchmark reads them.
func ExampleLogWriter() {
	var out bytes.Buffer
	w := rmm.NewLogWriter(&out)
	events := []rmm.LogEvent{
		{Thread: 851, Time: 0, Action: rmm.ActionAllocate, Pointer: 0x7f9718800000, Size: 2848464, Stream: 0x7f972cd265b0},
		{Thread: 851, Time: 52483 * time.Microsecond, Action: rmm.ActionAllocateFailure, Size: 1 << 40},
		{Thread: 851, Time: 90 * time.Millisecond, Action: rmm.ActionFree, Pointer: 0x7f9718800000, Size: 2848464, Stream: 0x7f972cd265b0},
	}
	for _, e := range events {
		if err := w.Write(e); err != nil {
			panic(err)
		}
	}
	if err := w.Flush(); err != nil {
		panic(err)
	}
	fmt.Print(out.String())
	// Output:
	// Thread,Time,Action,Pointer,Size,Stream
	// 851,00:00:00.000000,allocate,0x7f9718800000,2848464,0x7f972cd265b0
	// 851,00:00:00.052483,allocate failure,(nil),1099511627776,0
	// 851,00:00:00.090000,free,0x7f9718800000,2848464,0x7f972cd265b0
}
