package rmm

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/gormm/rmm/internal/errshape"
)

// The shape of this package's errors. Every error it returns reads
//
//	rmm: Op: what went wrong: cause
//
// Op is the call the user made (e.g. "PoolMemoryResource.Allocate", "NewUvector[int32]"), what
// went wrong says what was wrong and where, and cause is the sentinel below that the error wraps
// and/or the error that made it fail (a *CUDAError, an upstream's error). "rmm: " comes once, at
// the start, however deep the wrapping: an rmm error wrapped in another drops its own "rmm: ", as
// os.PathError and net.OpError name the operation once and leave their cause's text as it is.
//
// Sentinel errors. Every error this package returns wraps one of them (or is a *CUDAError), so
// callers test with errors.Is. A sentinel keeps "rmm: " in its text, so that one returned as it
// is reads in the shape too ("rmm: use after close"); wrapped, it reads without it, as the cause
// at the end of the message.
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

	// ErrNotExportable: memory cannot be shared with another process ([ExportIPC]) because of the
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

// Error reads "rmm: cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory": the driver
// function, then the status and the driver's description of it.
func (e *CUDAError) Error() string {
	return fmt.Sprintf("rmm: %s: %s (%d): %s", e.Op, e.Name, e.Code, e.Message)
}

// Is reports CUDA_ERROR_OUT_OF_MEMORY as [ErrOutOfMemory], and the driver's "no device" family
// (CUDA_ERROR_NO_DEVICE, CUDA_ERROR_STUB_LIBRARY, insufficient driver) as [ErrNoDevice].
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

// errorf is fmt.Errorf for this package's errors, and the one way they are made: it writes
// "rmm: " in front of the formatted text, and formats each error among args without its own
// leading "rmm: ", so that the message reads "rmm: Op: what went wrong: cause" with "rmm: " once
// (see errshape.Errorf). The errors given to %w are wrapped as fmt.Errorf wraps them. Op is the
// call that went wrong, which is not always the one the user made: an adaptor returns its
// upstream's errors unchanged, so a double free through a StatisticsResourceAdaptor over a pool
// names PoolMemoryResource.Deallocate.
func errorf(format string, args ...any) error { return errshape.Errorf(format, args...) }

// outOfMemory builds the error a resource's Allocate returns when it cannot provide nbytes.
// resource is the resource's type, optionally followed by " (figures)".
func outOfMemory(resource string, nbytes int, cause error) error {
	if cause != nil {
		return errorf("%s: failed to allocate %d bytes (%s): %w: %w", allocateOp(resource), nbytes, FormatBytes(int64(nbytes)), ErrOutOfMemory, cause)
	}
	return errorf("%s: failed to allocate %d bytes (%s): %w", allocateOp(resource), nbytes, FormatBytes(int64(nbytes)), ErrOutOfMemory)
}

// allocateOp names the call that ran out of memory, as every other error names its call:
// "PoolMemoryResource" becomes "PoolMemoryResource.Allocate", and "SimulatedMemoryResource
// (capacity 16, in use 16)" becomes "SimulatedMemoryResource.Allocate (capacity 16, in use 16)".
func allocateOp(resource string) string {
	name, figures, _ := strings.Cut(resource, " (")
	if figures != "" {
		return name + ".Allocate (" + figures
	}
	return name + ".Allocate"
}

// invalidSize is the error for a negative size given to resource.op.
func invalidSize(resource, op string, nbytes int) error {
	return errorf("%s.%s: negative size %d: %w", resource, op, nbytes, ErrInvalidArgument)
}

// OutOfMemoryError is the out-of-memory error of the sub-allocators (pool, arena, binning,
// fixed-size) and of [LimitingResourceAdaptor] (Limited): it carries the figures that tell whether
// the request failed for lack of memory or because the free memory is cut into pieces that are
// each too small (fragmentation).
// errors.Is(err, [ErrOutOfMemory]) holds; errors.As(err, &oom) gives the figures; Unwrap gives the
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
	// Limited: the request was refused by a byte limit ([LimitingResourceAdaptor]), not for lack of
	// memory. MaximumSize is then the limit (0 included), PoolSize the bytes charged against it,
	// Headroom what was left of it; FreeBytes and LargestFreeBlock are 0.
	Limited bool
	Detail  string // what failed, in words (e.g. "the upstream refused every size tried")
	Cause   error  // the upstream's error, or nil
}

// Error reads, for example: "rmm: PoolMemoryResource.Allocate: failed to allocate 2097152 bytes (2 MiB):
// maximum pool size reached; fragmentation: 3145728 bytes (3 MiB) free but the largest free block
// is 1048576 bytes (1 MiB); pool size 4194304 (4 MiB), maximum 4194304 (4 MiB): out of memory", or
// for a limit: "rmm: LimitingResourceAdaptor.Allocate (limit 1048576, allocated 700160): failed to allocate
// 500000 bytes (488.281 KiB): exceeded memory limit: out of memory". When the upstream refused to
// grow the resource, its error ends the message after "upstream: " (and says "out of memory"
// itself, once).
func (e *OutOfMemoryError) Error() string {
	var b strings.Builder
	b.WriteString(errshape.Prefix)
	if e.Limited {
		fmt.Fprintf(&b, "%s (limit %d, allocated %d): failed to allocate %d bytes (%s)", allocateOp(e.Resource), e.MaximumSize, e.PoolSize, e.Requested, FormatBytes(int64(e.Requested)))
		if e.Detail != "" {
			b.WriteString(": ")
			b.WriteString(e.Detail)
		}
		if e.TooLarge {
			b.WriteString("; the request is larger than the limit")
		}
		e.writeCause(&b)
		return b.String()
	}
	fmt.Fprintf(&b, "%s: failed to allocate %d bytes (%s)", allocateOp(e.Resource), e.Requested, FormatBytes(int64(e.Requested)))
	if e.Detail != "" {
		b.WriteString(": ")
		b.WriteString(e.Detail)
	}
	switch {
	case e.Fragmented:
		fmt.Fprintf(&b, "; fragmentation: %s free", bytesText(e.FreeBytes))
		if e.Headroom > 0 {
			fmt.Fprintf(&b, " (and %s more the pool may take)", bytesText(e.Headroom))
		}
		fmt.Fprintf(&b, " but the largest free block is %s", bytesText(e.LargestFreeBlock))
	case e.TooLarge && e.Detail != "": // the detail says why it is too large
		fmt.Fprintf(&b, "; %s free, largest free block %s", bytesText(e.FreeBytes), bytesText(e.LargestFreeBlock))
	case e.TooLarge:
		fmt.Fprintf(&b, "; larger than the resource can ever serve: %s free, largest free block %s", bytesText(e.FreeBytes), bytesText(e.LargestFreeBlock))
	default:
		fmt.Fprintf(&b, "; exhausted: %s free", bytesText(e.FreeBytes))
		if e.Headroom > 0 {
			fmt.Fprintf(&b, " and %s more the pool may take", bytesText(e.Headroom))
		}
		fmt.Fprintf(&b, ", largest free block %s", bytesText(e.LargestFreeBlock))
	}
	fmt.Fprintf(&b, "; pool size %s", sizeText(e.PoolSize))
	if e.MaximumSize > 0 {
		fmt.Fprintf(&b, ", maximum %s", sizeText(e.MaximumSize))
	} else {
		b.WriteString(", no maximum")
	}
	e.writeCause(&b)
	return b.String()
}

// writeCause ends the message: the sentinel, then the upstream's error; or the upstream's error
// alone where it is an out-of-memory error itself, so that the message says it once.
func (e *OutOfMemoryError) writeCause(b *strings.Builder) {
	if e.Cause == nil || !errors.Is(e.Cause, ErrOutOfMemory) {
		b.WriteString(": ")
		b.WriteString(errshape.Trim(ErrOutOfMemory))
	}
	if e.Cause != nil {
		b.WriteString(": upstream: ")
		b.WriteString(errshape.Trim(e.Cause))
	}
}

// bytesText is "n bytes (FormatBytes(n))" for a size shown to a reader; "n bytes" below a KiB.
func bytesText[N ~int | ~int64 | ~uint64 | ~uintptr | ~uint32 | ~int32](n N) string {
	if n < 1024 {
		return fmt.Sprintf("%d bytes", n)
	}
	return fmt.Sprintf("%d bytes (%s)", n, FormatBytes(int64(n)))
}

// sizeText is "n (FormatBytes(n))", for a figure already named a size; "n" below a KiB.
func sizeText(n int) string {
	if n < 1024 {
		return strconv.Itoa(n)
	}
	return fmt.Sprintf("%d (%s)", n, FormatBytes(int64(n)))
}

// Is makes errors.Is(err, [ErrOutOfMemory]) hold.
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
