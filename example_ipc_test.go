package rmm_test

import (
	"errors"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"

	"github.com/gormm/rmm"
)

// The producer side of sharing a vector with another process (the consumer is
// ExampleReceiveIPCHandle): memory from a pool whose physical memory can be exported, filled on
// the GPU, an event recorded after the fill, and both handles sent over a Unix domain socket.
// The vector and the event stay alive until the consumer says it is done. (Needs a GPU, and the
// consumer listening: not run as a test.)
func ExampleSendIPCHandle() {
	pool, err := rmm.NewPoolMemoryResource(nil, &rmm.PoolOptions{Expandable: true, Exportable: true})
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	s, err := rmm.NewStream(rmm.CurrentDevice(), nil)
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	v, err := rmm.NewUvector[float32](1<<20, s.View(), pool)
	if err != nil {
		log.Fatal(err)
	}
	defer v.Close()
	if err := v.Fill(1.5, s.View()); err != nil {
		log.Fatal(err)
	}
	ready, err := rmm.NewIPCEvent(rmm.CurrentDevice())
	if err != nil {
		log.Fatal(err)
	}
	defer ready.Close()
	if err := ready.Record(s.View()); err != nil { // after the fill
		log.Fatal(err)
	}

	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: filepath.Join(os.TempDir(), "rmm-ipc-example.sock"), Net: "unix"})
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	for _, export := range []func() (*rmm.IPCHandle, error){v.ExportIPC, ready.Export} {
		h, err := export()
		if err != nil {
			log.Fatal(err)
		}
		err = rmm.SendIPCHandle(conn, h)
		h.Close() // the receiver has its own copies of the descriptors
		if err != nil {
			log.Fatal(err)
		}
	}
	// The consumer writes one byte once it has closed its import.
	if _, err := conn.Read(make([]byte, 1)); err != nil {
		log.Fatal(err)
	}
}

// The consumer side (see ExampleSendIPCHandle): receive the vector's handle and the event's,
// map the memory, make a stream wait on the producer's event (on the device: the host does not
// block), read, and tell the producer when the import is closed.
func ExampleReceiveIPCHandle() {
	path := filepath.Join(os.TempDir(), "rmm-ipc-example.sock")
	os.Remove(path)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()
	conn, err := l.AcceptUnix()
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()

	h, err := rmm.ReceiveIPCHandle(conn)
	if err != nil {
		log.Fatal(err)
	}
	data, err := rmm.ImportIPC[float32](h)
	h.Close() // the import does not need the descriptors any more
	if err != nil {
		log.Fatal(err)
	}
	eh, err := rmm.ReceiveIPCHandle(conn)
	if err != nil {
		log.Fatal(err)
	}
	ready, err := rmm.OpenIPCEvent(eh)
	if err != nil {
		log.Fatal(err)
	}
	defer ready.Close()

	s, err := rmm.NewStream(data.Device(), nil)
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	if err := ready.StreamWait(s.View()); err != nil {
		log.Fatal(err)
	}
	host := make([]float32, data.Len())
	if err := data.CopyToHost(host, s.View()); err != nil {
		log.Fatal(err)
	}
	fmt.Println(len(host), host[0])
	if err := data.Close(); err != nil {
		log.Fatal(err)
	}
	if _, err := conn.Write([]byte{1}); err != nil {
		log.Fatal(err)
	}
}

// Memory from a resource that cannot be shared with another process says so, naming the
// resource; bytes that are not a handle are refused with ErrInvalidIPCHandle.
func ExampleExportIPC() {
	v, err := rmm.NewUvector[float64](1024, rmm.DefaultStream, rmm.NewSystemMemoryResource())
	if err != nil {
		log.Fatal(err)
	}
	defer v.Close()
	_, err = v.ExportIPC()
	fmt.Println(errors.Is(err, rmm.ErrNotExportable))
	fmt.Println(err)

	var h rmm.IPCHandle
	err = h.UnmarshalBinary([]byte("RMMH\x07"))
	fmt.Println(errors.Is(err, rmm.ErrInvalidIPCHandle))
	fmt.Println(err)
	// Output:
	// true
	// rmm: Uvector[float64].ExportIPC: SystemMemoryResource: it cannot export memory to other processes (exportable: CudaMemoryResource; CudaAsyncMemoryResource made with EnablePOSIXFileDescriptor; a PoolMemoryResource over those, or expandable and made with Exportable): memory cannot be exported
	// true
	// rmm: IPCHandle.UnmarshalBinary: 5 bytes: version 7; this package reads version 1: invalid IPC handle
}
