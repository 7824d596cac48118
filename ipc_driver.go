package rmm

// What the driver and the devices offer for interprocess sharing.

// Bits of cuIPCBound: the driver exports every function of the mechanism.
const (
	ipcBoundLegacy  = 1  // cuIpcGetMemHandle, cuIpcOpenMemHandle_v2, cuIpcCloseMemHandle, cuMemGetAddressRange_v2
	ipcBoundMemPool = 2  // cuMemPoolExportToShareableHandle, ...ImportFromShareableHandle, ...ExportPointer, ...ImportPointer
	ipcBoundVMM     = 4  // cuMemExportToShareableHandle, cuMemImportFromShareableHandle and the VMM functions
	ipcBoundEvent   = 8  // cuIpcGetEventHandle, cuIpcOpenEventHandle
	ipcBoundUUID    = 16 // cuDeviceGetUuid(_v2)
)

const (
	// memHandleTypePOSIXFD is CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.
	memHandleTypePOSIXFD = 1
	// CUdevice_attribute values for interprocess sharing.
	attrHandleTypePOSIXFDSupported  = 103 // VMM memory exportable as a POSIX fd
	attrMemPoolSupportedHandleTypes = 119 // CUDA 11.3; earlier drivers reject the id
	attrIPCEventSupported           = 125 // CUDA 12.0; earlier drivers reject the id
	// cuMemoryTypeDevice is CU_MEMORYTYPE_DEVICE.
	cuMemoryTypeDevice = 2
)

// ptrInfo is what cuPointerInfo reads about a pointer.
type ptrInfo struct {
	memType   int     // CUmemorytype; 0 for an address the driver does not know
	ordinal   int     // the device; -2 for none
	legacyIPC bool    // cuIpcGetMemHandle accepts its allocation
	pool      uintptr // the CUmemoryPool it came from (when asked)
}

// deviceAttrSince reads attribute attr of dev when the driver is at least version since (older
// drivers reject the id: asking would be a failing call); else it returns def.
func deviceAttrSince(dev Device, attr, since, def int) (int, error) {
	v, err := DriverVersion()
	if err != nil {
		return 0, err
	}
	if v < since {
		return def, nil
	}
	return dev.Attribute(attr)
}
