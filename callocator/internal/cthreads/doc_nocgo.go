//go:build !cgo

// Package cthreads needs cgo; built without it, it is empty.
package cthreads
