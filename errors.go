package rmm

import (
	"errors"
	"fmt"
	"strings"
)

// Sentinel errors. Every error this package returns wraps one of them (or is a *CUDAError), so
// callers test with errors.Is.
var (
	// ErrOutOfMemory: a resource could not provide the bytes asked for. The resource stays usable;
	// the call may succeed after memory is freed. CUDA_ERROR_OUT_OF_MEMORY maps to it.
	ErrOutOfMemory = errors.New("rmm: out of memory")

	// ErrInvalidArgument: a negative or overflowing size, a bad option, an alignment that is not a
	// power of two, a stream or device that does not fit the call.
	ErrInvalidArgument = errors.New("rmm: invalid argument")

	// ErrInvalidFree: Deallocate was given a pointer the resource never handed out or already
	// took back (a double free), or a size that differs from the one allocated. The resource's
	// state is unchanged.
	ErrInvalidFree = errors.New("rmm: invalid free")

	// ErrNoDevice: there is no usable CUDA driver or device (the wrapping error says why: library
	// missing, no device, driver too old, built without cgo).
	ErrNoDevice = errors.New("rmm: no CUDA device")

	// ErrOutOfRange: an element index outside a container, or a pop of the last level of a
	// StatisticsResourceAdaptor's counter stack.
	ErrOutOfRange = errors.New("rmm: index out of range")

	// ErrClosed: the resource, stream or container was closed.
	ErrClosed = errors.New("rmm: use after close")

	// ErrNotSupported: the memory or device does not support the operation (for example a fill
	// on memory that is neither host- nor device-accessible).
	ErrNotSupported = errors.New("rmm: not supported")

	// ErrNotExportable: memory cannot be shared with another process (ExportIPC) because of the
	// resource it came from, or how that resource was made; the error names the resource and
	// says what would make it exportable.
	ErrNotExportable = errors.New("rmm: memory cannot be exported")

	// ErrInvalidIPCHandle: bytes that are not a valid IPC handle of this package (truncated,
	// corrupt, another version), or a handle whose file descriptors do not match what it says
	// it carries.
	ErrInvalidIPCHandle = errors.New("rmm: invalid IPC handle")
)

// CUDAError is a CUDA driver call that returned a status other than CUDA_SUCCESS.
type CUDAError struct {
	Op      string // the driver function, e.g. "cuMemAlloc_v2"
	Code    int    // the CUresult value
	Name    string // e.g. "CUDA_ERROR_OUT_OF_MEMORY"
	Message string // the driver's description
}

func (e *CUDAError) Error() string {
	return fmt.Sprintf("rmm: %s: %s (%d): %s", e.Op, e.Name, e.Code, e.Message)
}

// Is reports CUDA_ERROR_OUT_OF_MEMORY as ErrOutOfMemory, and the driver's "no device" family
// (CUDA_ERROR_NO_DEVICE, CUDA_ERROR_STUB_LIBRARY, insufficient driver) as ErrNoDevice.
func (e *CUDAError) Is(target error) bool {
	switch target {
	case ErrOutOfMemory:
		return e.Code == cudaErrorOutOfMemory
	case ErrNoDevice:
		return e.Code == cudaErrorNoDevice || e.Code == cudaErrorStubLibrary ||
			e.Code == cudaErrorInsufficientDriver
	}
	return false
}

// outOfMemory builds the error a resource returns when it cannot provide nbytes.
func outOfMemory(resource string, nbytes int, cause error) error {
	if cause != nil {
		return fmt.Errorf("%w: %s failed to allocate %d bytes (%s): %w", ErrOutOfMemory, resource, nbytes, FormatBytes(int64(nbytes)), cause)
	}
	return fmt.Errorf("%w: %s failed to allocate %d bytes (%s)", ErrOutOfMemory, resource, nbytes, FormatBytes(int64(nbytes)))
}

// invalidSize is the error for a negative size given to resource.op.
func invalidSize(resource, op string, nbytes int) error {
	return fmt.Errorf("%w: %s.%s: negative size %d", ErrInvalidArgument, resource, op, nbytes)
}

// OutOfMemoryError is the out-of-memory error of the sub-allocators (pool, arena, binning,
// fixed-size) and of LimitingResourceAdaptor (Limited): it carries the figures that tell whether
// the request failed for lack of memory or because the free memory is cut into pieces that are
// each too small (fragmentation).
// errors.Is(err, ErrOutOfMemory) holds; errors.As(err, &oom) gives the figures; Unwrap gives the
// upstream's own error when the upstream refused to grow the resource.
type OutOfMemoryError struct {
	Resource         string // the resource's type, e.g. "PoolMemoryResource"
	Requested        int    // bytes asked for (before rounding)
	PoolSize         int    // bytes the resource holds from its upstream
	FreeBytes        int    // bytes of PoolSize not allocated
	LargestFreeBlock int    // bytes: the largest request the resource could serve without growing
	MaximumSize      int    // bytes the resource may hold at most; 0 when unbounded
	// Headroom is the bytes the resource could still have taken from its upstream when the
	// request failed: MaximumSize − PoolSize under a cap that the upstream did not refuse, else 0.
	Headroom int
	// Fragmented: FreeBytes + Headroom would hold the request, but no free block (with what could
	// be added next to it) is large enough: the memory is there, only not in one piece.
	Fragmented bool
	// TooLarge: no state of the resource could serve the request (it exceeds MaximumSize, or the
	// largest block the resource ever hands out, such as a fixed-size resource's block size).
	TooLarge bool
	// Limited: the request was refused by a byte limit (LimitingResourceAdaptor), not for lack of
	// memory. MaximumSize is then the limit (0 included), PoolSize the bytes charged against it,
	// Headroom what was left of it; FreeBytes and LargestFreeBlock are 0.
	Limited bool
	Detail  string // what failed, in words (e.g. "the upstream refused every size tried")
	Cause   error  // the upstream's error, or nil
}

// Error reads, for example: "rmm: out of memory: PoolMemoryResource failed to allocate 2097152
// bytes (2 MiB): maximum pool size reached; fragmentation: 3145728 bytes free but the
// largest free block is 1048576 bytes; pool size 4194304, maximum 4194304", or for a limit:
// "rmm: out of memory: LimitingResourceAdaptor (limit 1048576, allocated 700160) failed to
// allocate 500000 bytes (488.281 KiB): exceeded memory limit".
func (e *OutOfMemoryError) Error() string {
	var b strings.Builder
	if e.Limited {
		fmt.Fprintf(&b, "%v: %s (limit %d, allocated %d) failed to allocate %d bytes (%s)", ErrOutOfMemory, e.Resource, e.MaximumSize, e.PoolSize, e.Requested, FormatBytes(int64(e.Requested)))
		if e.Detail != "" {
			b.WriteString(": ")
			b.WriteString(e.Detail)
		}
		if e.TooLarge {
			b.WriteString("; the request is larger than the limit")
		}
		return b.String()
	}
	fmt.Fprintf(&b, "%v: %s failed to allocate %d bytes (%s)", ErrOutOfMemory, e.Resource, e.Requested, FormatBytes(int64(e.Requested)))
	if e.Detail != "" {
		b.WriteString(": ")
		b.WriteString(e.Detail)
	}
	switch {
	case e.Fragmented:
		fmt.Fprintf(&b, "; fragmentation: %d bytes free", e.FreeBytes)
		if e.Headroom > 0 {
			fmt.Fprintf(&b, " (and %d more the pool may take)", e.Headroom)
		}
		fmt.Fprintf(&b, " but the largest free block is %d bytes", e.LargestFreeBlock)
	case e.TooLarge:
		fmt.Fprintf(&b, "; larger than the resource can ever serve: %d bytes free, largest free block %d bytes", e.FreeBytes, e.LargestFreeBlock)
	default:
		fmt.Fprintf(&b, "; exhausted: %d bytes free", e.FreeBytes)
		if e.Headroom > 0 {
			fmt.Fprintf(&b, " and %d more the pool may take", e.Headroom)
		}
		fmt.Fprintf(&b, ", largest free block %d bytes", e.LargestFreeBlock)
	}
	fmt.Fprintf(&b, "; pool size %d", e.PoolSize)
	if e.MaximumSize > 0 {
		fmt.Fprintf(&b, ", maximum %d", e.MaximumSize)
	} else {
		b.WriteString(", no maximum")
	}
	if e.Cause != nil {
		// The cause is usually another out-of-memory error: say so once.
		b.WriteString(" (upstream: ")
		b.WriteString(strings.TrimPrefix(e.Cause.Error(), ErrOutOfMemory.Error()+": "))
		b.WriteString(")")
	}
	return b.String()
}

// Is makes errors.Is(err, ErrOutOfMemory) hold.
func (e *OutOfMemoryError) Is(target error) bool { return target == ErrOutOfMemory }

// Unwrap returns the upstream's error, or nil.
func (e *OutOfMemoryError) Unwrap() error { return e.Cause }

// newOutOfMemory fills in TooLarge (also when n exceeds MaximumSize) and Fragmented from the
// figures: the request (rounded to the resource's granule, n bytes) can be served at all and fits
// in FreeBytes + Headroom.
func newOutOfMemory(e OutOfMemoryError, n int) *OutOfMemoryError {
	e.TooLarge = e.TooLarge || (e.MaximumSize > 0 && n > e.MaximumSize)
	e.Fragmented = !e.TooLarge && n <= e.FreeBytes+e.Headroom
	return &e
}
