package rmm_test

import (
	"fmt"
	"log"

	"github.com/gormm/rmm"
)

// Memory allocated and used on one stream, then handed to another stream that uses it and frees
// it, as the MemoryResource contract asks of a caller: record an Event on the allocating stream
// after its last use, make the freeing stream wait for it, then free on the freeing stream (for a
// container, SetStream before Close). On a GPU the wait is on the device (the host does not
// block); without one, streams and events are host objects and the calls return at once.
func ExampleEvent() {
	pool, err := rmm.NewPoolMemoryResource(nil, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	producer, err := rmm.NewStream(rmm.CurrentDevice(), nil)
	if err != nil {
		log.Fatal(err)
	}
	defer producer.Close()
	consumer, err := rmm.NewStream(rmm.CurrentDevice(), nil)
	if err != nil {
		log.Fatal(err)
	}
	defer consumer.Close()

	v, err := rmm.NewUvector[int32](1000, producer.View(), pool)
	if err != nil {
		log.Fatal(err)
	}
	if err := v.Fill(7, producer.View()); err != nil { // queued on producer
		log.Fatal(err)
	}

	// Order consumer after everything queued on producer so far.
	ready, err := rmm.NewEvent(rmm.CurrentDevice(), nil)
	if err != nil {
		log.Fatal(err)
	}
	defer ready.Close()
	if err := ready.Record(producer.View()); err != nil {
		log.Fatal(err)
	}
	if err := consumer.View().WaitEvent(ready); err != nil {
		log.Fatal(err)
	}

	x, err := v.Element(999, consumer.View()) // sees the fill
	if err != nil {
		log.Fatal(err)
	}
	v.SetStream(consumer.View()) // Close now frees on consumer, after the wait
	if err := v.Close(); err != nil {
		log.Fatal(err)
	}
	fmt.Println(x, pool.Stats().LiveAllocations)
	// Output: 7 0
}
