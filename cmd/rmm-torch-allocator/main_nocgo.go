//go:build !cgo

// Command rmm-torch-allocator is a shared library for PyTorch built with cgo
// (go build -buildmode=c-shared); without cgo there is nothing to build.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "rmm-torch-allocator: built without cgo; build it with go build -buildmode=c-shared")
	os.Exit(2)
}
