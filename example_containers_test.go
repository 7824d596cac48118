package rmm_test

import (
	"fmt"
	"log"

	"github.com/gormm/rmm"
)

// A typed vector on the current device resource (device memory on a GPU, host memory
// elsewhere): allocate, fill, set the ends, copy back.
func ExampleUvector() {
	s := rmm.DefaultStream
	v, err := rmm.NewUvector[float32](6, s, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer v.Close()

	if err := v.Fill(1.5, s); err != nil { // asynchronous on s on the GPU
		log.Fatal(err)
	}
	if err := v.SetElement(0, -2, s); err != nil {
		log.Fatal(err)
	}
	if err := v.SetElement(v.Len()-1, 4, s); err != nil {
		log.Fatal(err)
	}
	host, err := v.ToSlice(s) // ordered after the fill; complete at return
	if err != nil {
		log.Fatal(err)
	}
	last, _ := v.Back(s)
	fmt.Println(v.Len(), host, last)

	// Growing past the capacity keeps the elements.
	if err := v.Resize(8, s); err != nil {
		log.Fatal(err)
	}
	fmt.Println(v.Len(), v.Cap())
	// Output:
	// 6 [-2 1.5 1.5 1.5 1.5 4] 4
	// 8 8
}

// A single value in device memory, as a kernel's result would be.
func ExampleScalar() {
	s := rmm.DefaultStream
	c, err := rmm.NewScalarWithValue(int64(41), s, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	v, _ := c.Value(s)
	if err := c.SetValue(v+1, s); err != nil {
		log.Fatal(err)
	}
	v, _ = c.Value(s)
	fmt.Println(v)
	if err := c.SetValueToZero(s); err != nil {
		log.Fatal(err)
	}
	v, _ = c.Value(s)
	fmt.Println(v)
	// Output:
	// 42
	// 0
}

// Untyped bytes: copy in, grow, copy a part out, deep copy.
func ExampleDeviceBuffer() {
	s := rmm.DefaultStream
	b, err := rmm.NewDeviceBufferFromHost([]byte("hello, device"), s, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	fmt.Println(b.Len(), b.Cap())

	if err := b.Reserve(64, s); err != nil { // capacity grows, size stays
		log.Fatal(err)
	}
	if err := b.Resize(5, s); err != nil { // within the capacity: only the size changes
		log.Fatal(err)
	}
	fmt.Println(b.Len(), b.Cap())

	c, err := b.Copy(s, nil) // a deep copy has capacity == size
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	out, _ := c.Bytes(s)
	fmt.Printf("%s %d %d\n", out, c.Len(), c.Cap())
	// Output:
	// 13 13
	// 5 64
	// hello 5 5
}
