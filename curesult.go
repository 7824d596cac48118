package rmm

// CUresult values this package interprets.
const (
	cudaSuccess                 = 0
	cudaErrorInvalidValue       = 1
	cudaErrorOutOfMemory        = 2
	cudaErrorNotInitialized     = 3
	cudaErrorDeinitialized      = 4
	cudaErrorStubLibrary        = 34
	cudaErrorInsufficientDriver = 35
	cudaErrorNoDevice           = 100
	cudaErrorInvalidDevice      = 101
	cudaErrorInvalidContext     = 201
	cudaErrorInvalidHandle      = 400
	cudaErrorNotFound           = 500
	cudaErrorNotReady           = 600
	cudaErrorIllegalAddress     = 700
	cudaErrorNotSupported       = 801
)

// cuErrorNames is the fallback for codes whose name the driver cannot give (no driver loaded).
var cuErrorNames = map[int]string{
	0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
	3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED", 34: "CUDA_ERROR_STUB_LIBRARY",
	35: "CUDA_ERROR_INSUFFICIENT_DRIVER", 100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE",
	201: "CUDA_ERROR_INVALID_CONTEXT", 400: "CUDA_ERROR_INVALID_HANDLE", 500: "CUDA_ERROR_NOT_FOUND",
	600: "CUDA_ERROR_NOT_READY", 700: "CUDA_ERROR_ILLEGAL_ADDRESS", 999: "CUDA_ERROR_UNKNOWN",
}
