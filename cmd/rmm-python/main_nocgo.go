//go:build !cgo

// Command rmm-python is a shared library for Python's GPU libraries built with cgo
// (go build -buildmode=c-shared); without cgo there is nothing to build.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "rmm-python: built without cgo; build it with go build -buildmode=c-shared")
	os.Exit(2)
}
