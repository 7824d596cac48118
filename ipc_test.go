package rmm

import (
	"encoding/binary"
	"hash/crc32"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// The IPC handle's encoding, its bad inputs, and the errors that need no GPU.

func testIPCHandles() map[string]*IPCHandle {
	uuid := [16]byte{0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	var data [64]byte
	for i := range data {
		data[i] = byte(i*7 + 1)
	}
	return map[string]*IPCHandle{
		"legacy":  {kind: IPCKindLegacy, dev: 1, uuid: uuid, size: 4096, offset: 512, data: data},
		"mempool": {kind: IPCKindMemPool, dev: 0, uuid: uuid, size: 1 << 28, data: data, nfds: 1},
		"vmm":     {kind: IPCKindVirtualMemory, dev: 3, uuid: uuid, size: 5 << 20, offset: 1 << 20, pieces: []int{2 << 20, 32 << 20}, nfds: 2},
		"event":   {kind: IPCKindEvent, dev: 2, uuid: uuid, data: data},
	}
}

func TestIPCHandleEncodingRoundTrip(t *testing.T) {
	for name, h := range testIPCHandles() {
		t.Run(name, func(t *testing.T) {
			b, err := h.MarshalBinary()
			require.NoError(t, err)
			require.Len(t, b, ipcMinBytes+8*len(h.pieces))
			var got IPCHandle
			require.NoError(t, got.UnmarshalBinary(b))
			require.Equal(t, *h, got)
			require.Equal(t, h.kind, got.Kind())
			require.Equal(t, h.size, got.Size())
			require.Equal(t, Device(h.dev), got.Device())
			require.Equal(t, h.uuid, got.DeviceUUID())
			require.Equal(t, h.nfds, got.NumFDs())
			require.Nil(t, got.FDs(), "descriptors do not travel as bytes")
			require.Equal(t, h.nfds == 0, got.attached())
			again, err := got.MarshalBinary()
			require.NoError(t, err)
			require.Equal(t, b, again)
			require.Contains(t, got.String(), h.kind.String())
		})
	}
}

// reencode rewrites the checksum of an encoded handle after a change, so that the decoder's
// checks past the checksum are reached.
func reencode(b []byte) []byte {
	n := len(b) - ipcChecksumBytes
	binary.LittleEndian.PutUint32(b[n:], crc32.Checksum(b[:n], ipcCRCTab))
	return b
}

func TestIPCHandleDecodeErrors(t *testing.T) {
	good, err := testIPCHandles()["vmm"].MarshalBinary()
	require.NoError(t, err)
	clone := func() []byte { return append([]byte(nil), good...) }
	encode := func(h *IPCHandle) []byte {
		b, err := h.MarshalBinary()
		require.NoError(t, err)
		return b
	}
	cases := []struct {
		name, want string
		b          []byte
	}{
		{"empty", "truncated", nil},
		{"magic only", "truncated", good[:4]},
		{"header only", "truncated", good[:ipcHeaderBytes]},
		{"one byte short", "truncated", good[:len(good)-1]},
		{"pieces cut", "truncated", good[:ipcMinBytes]},
		{"trailing byte", "after the handle's end", append(clone(), 0)},
		{"wrong magic", "magic", func() []byte { b := clone(); b[0] = 'X'; return b }()},
		{"garbage", "magic", []byte("hello, world, this is not a handle")},
		{"wrong version", "version 2", func() []byte { b := clone(); b[4] = 2; return b }()},
		{"wrong version, short", "version 9", []byte{'R', 'M', 'M', 'H', 9}},
		{"corrupt size", "checksum", func() []byte { b := clone(); b[30] ^= 1; return b }()},
		{"corrupt data", "checksum", func() []byte { b := clone(); b[60] ^= 0x80; return b }()},
		{"corrupt checksum", "checksum", func() []byte { b := clone(); b[len(b)-1] ^= 1; return b }()},
		{"reserved bytes", "reserved", func() []byte { b := clone(); b[6] = 1; return reencode(b) }()},
		{"unknown kind", "unknown kind 9", func() []byte { b := clone(); b[5] = 9; return reencode(b) }()},
		{"negative device", "device ordinal -1", func() []byte { b := clone(); binary.LittleEndian.PutUint32(b[8:], 0xffffffff); return reencode(b) }()},
		{"huge size", "out of range", func() []byte { b := clone(); binary.LittleEndian.PutUint64(b[28:], 1<<63); return reencode(b) }()},
		{"too many pieces", "pieces (at most", func() []byte { b := clone(); binary.LittleEndian.PutUint32(b[108:], ipcMaxPieces+1); return b }()},
		{"zero piece", "piece 1 has 0 bytes", encode(&IPCHandle{kind: IPCKindVirtualMemory, size: 1, pieces: []int{2 << 20, 0}, nfds: 2})},
		{"fd count mismatch (vmm)", "one file descriptor per piece", encode(&IPCHandle{kind: IPCKindVirtualMemory, size: 1, pieces: []int{2 << 20, 2 << 20}, nfds: 1})},
		{"fd count mismatch (mempool)", "carries 1 file descriptors", encode(&IPCHandle{kind: IPCKindMemPool, size: 1, nfds: 2})},
		{"fd on legacy", "carries 0 file descriptors", encode(&IPCHandle{kind: IPCKindLegacy, size: 1, nfds: 1})},
		{"range past pieces", "do not fit", encode(&IPCHandle{kind: IPCKindVirtualMemory, size: 2 << 20, offset: 1, pieces: []int{2 << 20}, nfds: 1})},
		{"empty range", "of 0 bytes", encode(&IPCHandle{kind: IPCKindLegacy, size: 0})},
		{"event with size", "an event handle", encode(&IPCHandle{kind: IPCKindEvent, size: 8})},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := *testIPCHandles()["legacy"]
			before := h
			err := h.UnmarshalBinary(c.b)
			require.ErrorIs(t, err, ErrInvalidIPCHandle)
			require.ErrorContains(t, err, c.want)
			require.Equal(t, before, h, "a failed UnmarshalBinary leaves the handle as it was")
		})
	}
	// Every single-bit flip of a valid encoding is caught.
	for i := range good {
		for bit := range 8 {
			b := clone()
			b[i] ^= 1 << bit
			var h IPCHandle
			require.ErrorIs(t, h.UnmarshalBinary(b), ErrInvalidIPCHandle, "byte %d bit %d", i, bit)
		}
	}
	// Every prefix is truncated, not a panic.
	for n := range len(good) {
		var h IPCHandle
		require.ErrorIs(t, h.UnmarshalBinary(good[:n]), ErrInvalidIPCHandle, "prefix of %d bytes", n)
	}
}

// ipcFuzzSeeds are crafted handles at the edges of what the decoder accepts (MarshalBinary
// encodes any fields): the largest sizes, offsets and piece counts, and one step past them.
func ipcFuzzSeeds() []*IPCHandle {
	return []*IPCHandle{
		{kind: IPCKindLegacy, size: math.MaxInt},
		{kind: IPCKindLegacy, size: 1, offset: math.MaxInt - 1},
		{kind: IPCKindLegacy, size: 2, offset: math.MaxInt - 1},
		{kind: IPCKindMemPool, size: 8, offset: 3, nfds: 1},
		{kind: IPCKindVirtualMemory, size: 1, offset: 4, pieces: []int{4, 1}, nfds: 2},
		{kind: IPCKindVirtualMemory, size: 1, offset: 5, pieces: []int{4, 1}, nfds: 2},
		{kind: IPCKindVirtualMemory, size: 1, pieces: []int{math.MaxInt, 1}, nfds: 2},
		{kind: IPCKindVirtualMemory, size: math.MaxInt, pieces: []int{math.MaxInt}, nfds: 1},
		{kind: IPCKindVirtualMemory, size: 1, pieces: []int{1}, nfds: ipcMaxPieces + 1},
		{kind: IPCKindEvent, dev: math.MaxInt32},
		{kind: IPCKindEvent, nfds: 1},
		{kind: IPCKindLegacy, dev: -1, size: 1},
	}
}

// The decoder answers every input with a handle whose fields agree with its kind and that encodes
// to the same bytes, or with ErrInvalidIPCHandle. Each input is also tried with its checksum
// made right, so that the fuzzer reaches the checks behind it.
func FuzzIPCHandleDecode(f *testing.F) {
	for _, h := range testIPCHandles() {
		b, _ := h.MarshalBinary()
		f.Add(b)
	}
	for _, h := range ipcFuzzSeeds() {
		b, _ := h.MarshalBinary()
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		checkIPCDecode(t, b)
		if len(b) >= ipcMinBytes {
			checkIPCDecode(t, reencode(append([]byte(nil), b...)))
		}
	})
}

func checkIPCDecode(t *testing.T, b []byte) {
	var h IPCHandle
	if err := h.UnmarshalBinary(b); err != nil {
		require.ErrorIs(t, err, ErrInvalidIPCHandle)
		return
	}
	require.NoError(t, h.checkShape())
	require.GreaterOrEqual(t, h.dev, 0)
	require.Equal(t, h.nfds, h.NumFDs())
	require.Equal(t, h.nfds == 0, h.attached())
	_ = h.String()
	again, err := h.MarshalBinary()
	require.NoError(t, err)
	require.Equal(t, b, again, "a decoded handle encodes to the same bytes")
}

func TestIPCHandleMisuse(t *testing.T) {
	var zero IPCHandle
	_, err := zero.MarshalBinary()
	require.ErrorIs(t, err, ErrInvalidArgument)
	var nilh *IPCHandle
	_, err = nilh.MarshalBinary()
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.NoError(t, nilh.Close())
	require.Equal(t, "IPCHandle(nil)", nilh.String())

	h := *testIPCHandles()["vmm"]
	require.False(t, h.attached())
	require.Contains(t, h.String(), "not attached")
	err = h.SetFDs([]int{5})
	require.ErrorIs(t, err, ErrInvalidIPCHandle)
	require.ErrorContains(t, err, "carries 2 file descriptors, 1 given")
	require.ErrorIs(t, h.SetFDs([]int{5, -1}), ErrInvalidIPCHandle)
	require.Nil(t, h.FDs(), "a failed SetFDs takes nothing")
	require.ErrorIs(t, h.SetFDs(nil), ErrInvalidIPCHandle)
	var none IPCHandle
	require.NoError(t, none.UnmarshalBinary(mustMarshal(t, testIPCHandles()["legacy"])))
	require.NoError(t, none.SetFDs(nil), "a handle that carries no descriptors takes none")
	require.True(t, none.attached())
	held := IPCHandle{nfds: 1, fds: []int{-1}}
	require.ErrorIs(t, held.UnmarshalBinary(mustMarshal(t, testIPCHandles()["legacy"])), ErrInvalidArgument, "a handle holding descriptors")
	require.ErrorIs(t, held.SetFDs([]int{3}), ErrInvalidArgument, "descriptors attached already")
}

// A descriptor given twice to SetFDs is refused: the handle's Close closed it twice, the second
// time closing whatever the process had opened under that number in between.
func TestIPCHandleSetFDsRepeated(t *testing.T) {
	var h IPCHandle
	require.NoError(t, h.UnmarshalBinary(mustMarshal(t, &IPCHandle{kind: IPCKindVirtualMemory, size: 1, pieces: []int{2 << 20, 2 << 20, 2 << 20}, nfds: 3})))
	err := h.SetFDs([]int{7, 8, 7})
	require.ErrorIs(t, err, ErrInvalidIPCHandle)
	require.ErrorContains(t, err, "IPCHandle.SetFDs: descriptors 0 and 2 are both 7")
	require.Nil(t, h.FDs(), "a failed SetFDs takes nothing")
	require.False(t, h.attached())
}

func mustMarshal(t *testing.T, h *IPCHandle) []byte {
	t.Helper()
	b, err := h.MarshalBinary()
	require.NoError(t, err)
	return b
}

func TestIPCDeviceMatchByUUID(t *testing.T) {
	a := [16]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}
	b := [16]byte{0xaa, 0xbb}
	c := [16]byte{0xcc}
	d, err := matchIPCDevice(b, 0, [][16]byte{a, b})
	require.NoError(t, err)
	require.Equal(t, Device(1), d, "the device is found by UUID, whatever its ordinal in the exporter")
	_, err = matchIPCDevice(c, 3, [][16]byte{a, b})
	require.ErrorIs(t, err, ErrNoDevice)
	require.ErrorContains(t, err, formatUUID(c))
	require.ErrorContains(t, err, "device 3 in the exporting process")
	require.ErrorContains(t, err, "1: "+formatUUID(b))
	require.Equal(t, "GPU-01020304-0506-0708-090a-0b0c0d0e0f10", formatUUID(a))
}
