package rmm

// cudaDriver is the CUDA that the arena, the pool and the fixed-size resource call about streams
// and events. Tests put a fake in its place to follow the calls without a device
// (arenaSyncFake).
type cudaDriver struct {
	ctxSynchronize    func(ctx uintptr) error
	streamSynchronize func(ctx, s uintptr) error
	streamQuery       func(ctx, s uintptr) (bool, error)
	streamWaitEvent   func(ctx, s, e uintptr) error
	recordAndWait     func(ctx, e, from, to uintptr) error
	eventCreate       func(ctx uintptr, flags uint) (uintptr, error)
	eventRecord       func(ctx, e, s uintptr) error
	eventSynchronize  func(ctx, e uintptr) error
	eventDestroy      func(ctx, e uintptr) error
}

var cudaCalls = cudaDriver{
	ctxSynchronize:    cuCtxSynchronize,
	streamSynchronize: cuStreamSynchronize,
	streamQuery:       cuStreamQuery,
	streamWaitEvent:   cuStreamWaitEvent,
	recordAndWait:     cuRecordAndWait,
	eventCreate:       cuEventCreate,
	eventRecord:       cuEventRecord,
	eventSynchronize:  cuEventSynchronize,
	eventDestroy:      cuEventDestroy,
}
