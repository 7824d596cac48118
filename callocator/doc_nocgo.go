//go:build !cgo

// Package callocator needs cgo (a C compiler) to hand Go memory resources to C code; built
// without it, it is empty.
package callocator
