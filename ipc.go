package rmm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"strings"
	"sync"
)

// Sharing device memory between processes (CUDA IPC).
//
// The exporting process turns a live allocation into an *IPCHandle (ExportIPC, or the
// containers' ExportIPC methods), sends it to another process (SendIPCHandle over a Unix domain
// socket, which carries the handle's file descriptors with SCM_RIGHTS), and the importing process
// maps the same memory into its own address space (ImportIPC), getting an *IPCSpan: a DeviceSpan
// over the imported memory plus a Close that unmaps it. Work in the two processes is ordered
// with an IPCEvent: the producer records it after its writes and exports it once; the consumer
// opens it and makes its stream wait on it (StreamWait), with no round trip through the host.
//
// Three mechanisms, chosen by the resource the memory came from (IPCKind):
//   - IPCKindMemPool: CudaAsyncMemoryResource made with EnablePOSIXFileDescriptor. The pool
//     travels as a file descriptor (cuMemPoolExportToShareableHandle) and the allocation as 64
//     opaque bytes (cuMemPoolExportPointer); the importer imports the pool and the pointer
//     (cuMemPoolImportFromShareableHandle, cuMemPoolImportPointer), and its Close frees the
//     imported pointer (cuMemFree) and destroys the imported pool.
//   - IPCKindVirtualMemory: an expandable PoolMemoryResource made with PoolOptions.Exportable.
//     Each piece of physical memory (chunk) under the range travels as a file descriptor
//     (cuMemExportToShareableHandle); the importer reserves an address range, imports and maps
//     the pieces back to back in it and grants access (cuMemImportFromShareableHandle, cuMemMap,
//     cuMemSetAccess); Close unmaps, releases and frees the range.
//   - IPCKindLegacy: memory from cuMemAlloc (CudaMemoryResource, or a plain PoolMemoryResource
//     over one): 64 opaque bytes for the allocation that holds the range (cuIpcGetMemHandle) plus
//     the range's offset in it; the importer opens it (cuIpcOpenMemHandle, peer access enabled
//     lazily) and Close closes it (cuIpcCloseMemHandle).
//
// Lifetime. The exporter must keep the memory allocated (the container open, the resource
// alive) until every importer has closed its IPCSpan; the CUDA documentation asks the same. What
// happens otherwise depends on the mechanism:
//   - virtual memory: an imported piece holds its physical memory alive until the importer
//     unmaps and releases it, so an importer keeps reading valid (if stale) memory after the
//     exporter freed the range or exited; but the exporter's pool may hand the same memory to
//     a new allocation meanwhile, so the two processes then share it unknowingly;
//   - memory pools: the driver documentation requires imported pointers to be freed in every
//     importing process before the exporting process frees the allocation; doing otherwise is
//     undefined behaviour;
//   - cuIpcGetMemHandle memory: the driver documentation defines only the importer's close, not
//     what an importer sees after the exporter freed the allocation or exited: treat it as
//     undefined.
//
// A handle's file descriptors belong to it: Close closes them. Send a handle, then Close it;
// import a received handle, then Close it (importing does not need it afterwards). A handle
// holds no device resources, so closing it does not affect exported or imported memory.
//
// Linux only in practice: the driver exports POSIX file descriptors, and legacy IPC needs
// unified addressing on Linux.

// IPCKind says how memory (or an event) was exported, and so how it is imported.
type IPCKind uint8

const (
	// IPCKindMemPool: an allocation of a [CudaAsyncMemoryResource] made with
	// EnablePOSIXFileDescriptor; one file descriptor (the pool) and 64 opaque bytes.
	IPCKindMemPool IPCKind = 1
	// IPCKindVirtualMemory: memory of an expandable [PoolMemoryResource] made with Exportable; one
	// file descriptor per piece of physical memory under the range.
	IPCKindVirtualMemory IPCKind = 2
	// IPCKindLegacy: memory from cuMemAlloc; 64 opaque bytes (cuIpcGetMemHandle), no descriptor.
	IPCKindLegacy IPCKind = 3
	// IPCKindEvent: an [IPCEvent]; 64 opaque bytes (cuIpcGetEventHandle), no descriptor.
	IPCKindEvent IPCKind = 4
)

func (k IPCKind) String() string {
	switch k {
	case IPCKindMemPool:
		return "memory pool"
	case IPCKindVirtualMemory:
		return "virtual memory"
	case IPCKindLegacy:
		return "cuIpcGetMemHandle"
	case IPCKindEvent:
		return "event"
	}
	return fmt.Sprintf("IPCKind(%d)", uint8(k))
}

// IPCHandle is memory or an event exported by one process for another to import: what the
// importer needs (the kind, the device, the range's size and offset, opaque driver data) plus
// the file descriptors that carry the memory, if any. MarshalBinary gives the bytes without the
// descriptors, which only [SendIPCHandle] (SCM_RIGHTS) or SetFDs can carry. An IPCHandle is not
// safe for concurrent use.
type IPCHandle struct {
	kind   IPCKind
	dev    int      // the device's ordinal in the exporting process
	uuid   [16]byte // the device's UUID
	size   int      // bytes of the shared range
	offset int      // bytes from the start of what is imported to the range
	data   [64]byte // the driver's opaque bytes (IPCKindMemPool, IPCKindLegacy, IPCKindEvent)
	pieces []int    // IPCKindVirtualMemory: the size of each piece, in address order
	nfds   int      // the descriptors the handle carries
	fds    []int    // attached descriptors (nfds of them), owned; nil when not attached
}

// Kind returns how the handle's memory or event was exported.
func (h *IPCHandle) Kind() IPCKind { return h.kind }

// Size returns the bytes of the shared range (0 for an event).
func (h *IPCHandle) Size() int { return h.size }

// Device returns the device's ordinal in the exporting process. The importing process may
// number its devices differently (CUDA_VISIBLE_DEVICES): [ImportIPC] finds the device by its UUID.
func (h *IPCHandle) Device() Device { return Device(h.dev) }

// DeviceUUID returns the UUID of the device the memory or event lives on.
func (h *IPCHandle) DeviceUUID() [16]byte { return h.uuid }

// NumFDs returns the number of file descriptors the handle carries: 1 for [IPCKindMemPool], one
// per piece for [IPCKindVirtualMemory], 0 otherwise. They are attached when the handle comes from
// an export or [ReceiveIPCHandle]; after UnmarshalBinary, SetFDs attaches them.
func (h *IPCHandle) NumFDs() int { return h.nfds }

// FDs returns a copy of the attached file descriptors (nil when none are attached). They stay
// owned by the handle: do not close them.
func (h *IPCHandle) FDs() []int {
	if h.fds == nil {
		return nil
	}
	return append([]int(nil), h.fds...)
}

// SetFDs attaches the descriptors the handle carries, in the exporter's order, for a handle
// decoded with UnmarshalBinary whose descriptors travelled another way. The handle takes them
// over: Close closes them. It returns an error wrapping [ErrInvalidIPCHandle], and takes nothing,
// when their count is not NumFDs(), one is negative or one is given twice, and
// [ErrInvalidArgument] when descriptors are attached already.
func (h *IPCHandle) SetFDs(fds []int) error {
	if h.fds != nil {
		return errorf("IPCHandle.SetFDs: the handle has its descriptors already: %w", ErrInvalidArgument)
	}
	if len(fds) != h.nfds {
		return errorf("IPCHandle.SetFDs: the handle carries %d file descriptors, %d given: %w", h.nfds, len(fds), ErrInvalidIPCHandle)
	}
	seen := make(map[int]int, len(fds))
	for i, fd := range fds {
		if fd < 0 {
			return errorf("IPCHandle.SetFDs: descriptor %d is %d: %w", i, fd, ErrInvalidIPCHandle)
		}
		if j, ok := seen[fd]; ok {
			return errorf("IPCHandle.SetFDs: descriptors %d and %d are both %d (each piece travels in a descriptor of its own, and Close would close it twice): %w", j, i, fd, ErrInvalidIPCHandle)
		}
		seen[fd] = i
	}
	if len(fds) > 0 {
		h.fds = append([]int(nil), fds...)
	}
	return nil
}

// Close closes the file descriptors the handle holds. Imported and exported memory is not
// affected. Closing twice returns nil.
func (h *IPCHandle) Close() error {
	if h == nil || h.fds == nil {
		return nil
	}
	fds := h.fds
	h.fds = nil
	return closeFDs(fds)
}

// attached reports whether the handle holds the descriptors it carries (vacuously for none).
func (h *IPCHandle) attached() bool { return len(h.fds) == h.nfds }

func (h *IPCHandle) String() string {
	if h == nil {
		return "IPCHandle(nil)"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "IPCHandle(%s, device %d %s, %d bytes at offset %d", h.kind, h.dev, formatUUID(h.uuid), h.size, h.offset)
	if len(h.pieces) > 0 {
		fmt.Fprintf(&b, ", %d pieces", len(h.pieces))
	}
	if h.nfds > 0 {
		fmt.Fprintf(&b, ", %d fds", h.nfds)
		if !h.attached() {
			b.WriteString(" not attached")
		}
	}
	b.WriteString(")")
	return b.String()
}

// ---- encoding ----

// The encoding, little-endian: magic "RMMH", version, kind, two reserved bytes (zero), the
// device ordinal (int32), its UUID (16 bytes), size and offset (uint64), the driver's opaque
// bytes (64; zero where unused), the number of pieces and of descriptors (uint32), each piece's
// size (uint64), and a CRC-32C of everything before it.
const (
	ipcVersion       = 1
	ipcHeaderBytes   = 116
	ipcChecksumBytes = 4
	ipcMinBytes      = ipcHeaderBytes + ipcChecksumBytes
	// ipcMaxPieces bounds the pieces of one handle: a 1 TiB range in 2 MiB pieces.
	ipcMaxPieces = 1 << 19
)

var (
	ipcMagic  = [4]byte{'R', 'M', 'M', 'H'}
	ipcCRCTab = crc32.MakeTable(crc32.Castagnoli)
)

// MarshalBinary encodes the handle (without its file descriptors, which cannot travel as
// bytes). It implements encoding.BinaryMarshaler.
func (h *IPCHandle) MarshalBinary() ([]byte, error) {
	if h == nil || h.kind == 0 {
		return nil, errorf("MarshalBinary of a nil or zero IPCHandle: %w", ErrInvalidArgument)
	}
	b := make([]byte, ipcHeaderBytes, ipcMinBytes+8*len(h.pieces))
	copy(b[0:4], ipcMagic[:])
	b[4] = ipcVersion
	b[5] = byte(h.kind)
	binary.LittleEndian.PutUint32(b[8:], uint32(int32(h.dev)))
	copy(b[12:28], h.uuid[:])
	binary.LittleEndian.PutUint64(b[28:], uint64(h.size))
	binary.LittleEndian.PutUint64(b[36:], uint64(h.offset))
	copy(b[44:108], h.data[:])
	binary.LittleEndian.PutUint32(b[108:], uint32(len(h.pieces)))
	binary.LittleEndian.PutUint32(b[112:], uint32(h.nfds))
	for _, p := range h.pieces {
		b = binary.LittleEndian.AppendUint64(b, uint64(p))
	}
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, ipcCRCTab)), nil
}

// UnmarshalBinary decodes a handle encoded by MarshalBinary. The handle then carries NumFDs()
// descriptors that are not attached ([ReceiveIPCHandle] attaches them; otherwise SetFDs). Bytes
// that are truncated, corrupt, of another version or inconsistent return an error wrapping
// [ErrInvalidIPCHandle] that says what is wrong, and leave h unchanged, as does a handle holding
// descriptors ([ErrInvalidArgument]: Close it first). It implements encoding.BinaryUnmarshaler.
func (h *IPCHandle) UnmarshalBinary(b []byte) error {
	if h.fds != nil {
		return errorf("IPCHandle.UnmarshalBinary into a handle holding file descriptors (Close it first): %w", ErrInvalidArgument)
	}
	d, err := decodeIPCHandle(b)
	if err != nil {
		return errorf("IPCHandle.UnmarshalBinary: %w", err)
	}
	*h = *d
	return nil
}

func decodeIPCHandle(b []byte) (*IPCHandle, error) {
	bad := func(format string, args ...any) error {
		return errorf("%s: %s: %w", bytesText(len(b)), fmt.Sprintf(format, args...), ErrInvalidIPCHandle)
	}
	n := min(len(b), 4)
	if string(b[:n]) != string(ipcMagic[:n]) {
		return nil, bad("not an IPC handle of this package (magic % x, want % x)", b[:n], ipcMagic[:])
	}
	if len(b) > 4 && b[4] != ipcVersion {
		return nil, bad("version %d; this package reads version %d", b[4], ipcVersion)
	}
	if len(b) < ipcMinBytes {
		return nil, bad("truncated: a handle has at least %d bytes", ipcMinBytes)
	}
	npieces := binary.LittleEndian.Uint32(b[108:])
	if npieces > ipcMaxPieces {
		return nil, bad("%d pieces (at most %d)", npieces, ipcMaxPieces)
	}
	want := ipcMinBytes + 8*int(npieces)
	if len(b) < want {
		return nil, bad("truncated: %d pieces need %d bytes", npieces, want)
	}
	if len(b) > want {
		return nil, bad("%d bytes after the handle's end (%d pieces make %d bytes)", len(b)-want, npieces, want)
	}
	if sum, got := crc32.Checksum(b[:want-ipcChecksumBytes], ipcCRCTab), binary.LittleEndian.Uint32(b[want-ipcChecksumBytes:]); sum != got {
		return nil, bad("corrupt: checksum %#08x, computed %#08x", got, sum)
	}
	if b[6] != 0 || b[7] != 0 {
		return nil, bad("reserved bytes %#x %#x are not zero", b[6], b[7])
	}
	h := &IPCHandle{kind: IPCKind(b[5]), dev: int(int32(binary.LittleEndian.Uint32(b[8:])))}
	copy(h.uuid[:], b[12:28])
	size, offset := binary.LittleEndian.Uint64(b[28:]), binary.LittleEndian.Uint64(b[36:])
	copy(h.data[:], b[44:108])
	nfds := binary.LittleEndian.Uint32(b[112:])
	if size > math.MaxInt || offset > math.MaxInt || uint64(nfds) > ipcMaxPieces {
		return nil, bad("size %d, offset %d or descriptor count %d out of range", size, offset, nfds)
	}
	h.size, h.offset, h.nfds = int(size), int(offset), int(nfds)
	if h.dev < 0 {
		return nil, bad("device ordinal %d", h.dev)
	}
	if npieces > 0 {
		h.pieces = make([]int, npieces)
		for i := range h.pieces {
			v := binary.LittleEndian.Uint64(b[ipcHeaderBytes+8*i:])
			if v == 0 || v > math.MaxInt {
				return nil, bad("piece %d has %d bytes", i, v)
			}
			h.pieces[i] = int(v)
		}
	}
	if err := h.checkShape(); err != nil {
		return nil, bad("%v", err)
	}
	return h, nil
}

// checkShape checks that the handle's fields agree with its kind.
func (h *IPCHandle) checkShape() error {
	switch h.kind {
	case IPCKindMemPool, IPCKindLegacy:
		want := 0
		if h.kind == IPCKindMemPool {
			want = 1
		}
		if h.nfds != want || len(h.pieces) != 0 {
			return errorf("a %s handle carries %d file descriptors and no pieces, not %d and %d", h.kind, want, h.nfds, len(h.pieces))
		}
		if h.size <= 0 || h.offset > math.MaxInt-h.size {
			return errorf("a %s handle of %s at offset %d", h.kind, bytesText(h.size), h.offset)
		}
	case IPCKindVirtualMemory:
		if len(h.pieces) == 0 || h.nfds != len(h.pieces) {
			return errorf("a %s handle carries one file descriptor per piece: %d pieces, %d descriptors", h.kind, len(h.pieces), h.nfds)
		}
		total := 0
		for _, p := range h.pieces {
			if p > math.MaxInt-total {
				return errors.New("the pieces' sizes overflow")
			}
			total += p
		}
		if h.size <= 0 || h.offset > total || h.size > total-h.offset {
			return errorf("%s at offset %d do not fit in the %s of the pieces", bytesText(h.size), h.offset, bytesText(total))
		}
	case IPCKindEvent:
		if h.nfds != 0 || len(h.pieces) != 0 || h.size != 0 || h.offset != 0 {
			return errorf("an event handle with %d descriptors, %d pieces, size %d, offset %d", h.nfds, len(h.pieces), h.size, h.offset)
		}
	default:
		return errorf("unknown kind %d", uint8(h.kind))
	}
	return nil
}

// ---- devices ----

var deviceUUIDs sync.Map // Device -> [16]byte

// UUID returns the device's 16-byte UUID (cuDeviceGetUuid), which names the device across
// processes whatever its ordinal there (CUDA_VISIBLE_DEVICES may renumber devices). Without CUDA
// the error wraps [ErrNoDevice].
func (d Device) UUID() ([16]byte, error) {
	if v, ok := deviceUUIDs.Load(d); ok {
		return v.([16]byte), nil
	}
	if err := initDriver(); err != nil {
		return [16]byte{}, err
	}
	if err := d.check(); err != nil {
		return [16]byte{}, errorf("Device.UUID: %w", err)
	}
	if cuIPCBound()&ipcBoundUUID == 0 {
		return [16]byte{}, errorf("%s: the CUDA driver lacks cuDeviceGetUuid: %w", d, ErrNotSupported)
	}
	u, err := cuDeviceUUID(int(d))
	if err != nil {
		return [16]byte{}, errorf("%s: %w", d, err)
	}
	deviceUUIDs.Store(d, u)
	return u, nil
}

// formatUUID writes a device UUID as nvidia-smi does: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
func formatUUID(u [16]byte) string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// ipcLocalDevice returns this process's device with the UUID uuid (the exporter's ordinal ord is
// only for the message).
func ipcLocalDevice(uuid [16]byte, ord int) (Device, error) {
	if err := initDriver(); err != nil {
		return 0, err
	}
	locals := make([][16]byte, DeviceCount())
	for i := range locals {
		u, err := Device(i).UUID()
		if err != nil {
			return 0, err
		}
		locals[i] = u
	}
	return matchIPCDevice(uuid, ord, locals)
}

// matchIPCDevice returns the index of uuid in locals, the UUIDs of this process's devices.
func matchIPCDevice(uuid [16]byte, ord int, locals [][16]byte) (Device, error) {
	for i, u := range locals {
		if u == uuid {
			return Device(i), nil
		}
	}
	names := make([]string, len(locals))
	for i, u := range locals {
		names[i] = fmt.Sprintf("%d: %s", i, formatUUID(u))
	}
	return 0, errorf("the handle's device %s (device %d in the exporting process) is not visible in this process (its devices: %s): %w", formatUUID(uuid), ord, strings.Join(names, ", "), ErrNoDevice)
}
