// Package rmm is a GPU memory manager for Go: a port of the RAPIDS Memory Manager (RMM).
//
// Programs allocate typed device memory — [Uvector], [Scalar], [DeviceBuffer] — through
// pluggable, stream-ordered memory resources (the [MemoryResource] interface), and stack adaptors
// on them:
//
//   - Resources: [CudaMemoryResource] (cuMemAlloc), [ManagedMemoryResource] (cuMemAllocManaged),
//     [CudaAsyncMemoryResource] (the driver's stream-ordered pools) and
//     [CudaAsyncViewMemoryResource] (a view of an existing one), [SystemMemoryResource] (host
//     memory), [PinnedMemoryResource] (page-locked host memory), [PageableMemoryResource] (a
//     [HostMemoryResource] over the C heap), [SamHeadroomMemoryResource],
//     [CallbackMemoryResource] (your functions), [SimulatedMemoryResource] (addresses without
//     memory, for replaying and testing).
//   - Sub-allocators, whose allocations cost nanoseconds instead of the driver's microseconds:
//     [PoolMemoryResource] (coalescing best fit; expandable with [PoolOptions].Expandable, and
//     stitching with [PoolOptions].Stitch: the default [PoolKind], which [Reinitialize] builds),
//     [ArenaMemoryResource] (per-stream arenas of superblocks), [FixedSizeMemoryResource] and
//     [BinningMemoryResource].
//   - Adaptors: [LoggingResourceAdaptor] writes RMM's CSV event log, which [ReadLog] reads back
//     and [Replay] (and the rmm-replay command) replays against any resource.
//     [StatisticsResourceAdaptor] counts current, peak and total bytes on a stack of levels
//     ([EnableStatistics], [WithStatistics], and [Profiler] for named blocks of code);
//     [StreamStatisticsResourceAdaptor] counts the same figures stream by stream;
//     [TrackingResourceAdaptor] lists what was never freed; [MemoryProfileResourceAdaptor]
//     samples the call stacks of allocations into a pprof profile of device memory (go tool
//     pprof, [MemoryProfileHandler]); [LimitingResourceAdaptor] caps the bytes handed out;
//     [FailureCallbackResourceAdaptor] lets a callback free memory and retry;
//     [PrefetchResourceAdaptor] prefetches managed memory to the GPU; [AlignedResourceAdaptor]
//     aligns to more than 256 bytes; [ThreadSafeResourceAdaptor] serialises a resource of one's
//     own.
//
// # Constructors and the upstream
//
// Every adaptor constructor (NewXxxResourceAdaptor) takes its upstream first and returns the
// adaptor and an error: each checks its upstream and its options, and some ask the driver about
// the device, so one shape serves them all and a new option never changes a signature. The
// sub-allocators' constructors have the same shape. A nil upstream means the current device
// resource ([CurrentDeviceResource]) at the time of the call: the adaptor keeps that resource when
// the current one changes later. A nil pointer as an adaptor's upstream (a nil
// [*PoolMemoryResource], say) returns an error wrapping [ErrInvalidArgument] at once, rather than
// a panic at the first allocation. Options are passed by pointer; nil means the defaults, which
// each field's comment states.
//
// # Devices, streams, the current resource
//
// A [Device] is a CUDA ordinal. The package loads libcuda.so.1 itself when first used (no CUDA
// toolkit is needed to build), and makes each device's primary context current inside every
// driver call, so goroutines need not lock OS threads. Work is ordered on streams: [StreamView]
// is a comparable, non-owning reference ([DefaultStream] is the legacy default stream), [Stream]
// owns one. Memory allocated on a stream may be used by work on that stream; another stream needs
// an ordering edge (an [Event], see [StreamView.WaitEvent]) first.
//
// Every device has a current resource ([CurrentDeviceResource], [SetCurrentDeviceResource],
// [PerDeviceResource]): a [CudaMemoryResource] until something else is set (a
// [SystemMemoryResource] without CUDA), or what [Reinitialize] installs. A nil [MemoryResource]
// argument, to a container or a constructor, means the current device resource.
//
// # Sharing memory between processes
//
// [ExportIPC] (and the ExportIPC methods of [DeviceBuffer] and [Uvector]) turns live memory into
// an [IPCHandle]; [SendIPCHandle] and [ReceiveIPCHandle] carry it, with its file descriptors, over
// a Unix domain socket; [ImportIPC] maps it in the other process as an [IPCSpan], a [DeviceSpan]
// with a Close. An [IPCEvent] orders the two processes' work on the device. Exportable memory
// comes from a [CudaMemoryResource] (cuIpcGetMemHandle), a [CudaAsyncMemoryResource] made with
// [CudaAsyncOptions].EnablePOSIXFileDescriptor (the pool's export), and a [PoolMemoryResource]
// over either, or expandable and made with [PoolOptions].Exportable (the physical memory's
// export). The exporter keeps the memory allocated until every importer has closed it.
//
// # Without a GPU
//
// On a machine with no CUDA driver or device, [CUDAAvailable] reports why, the current resource
// is a [SystemMemoryResource], streams are host streams and containers fill and copy on the CPU:
// the same program runs, on host memory.
//
// # Errors
//
// Failures wrap the sentinel errors (test with [errors.Is]): [ErrOutOfMemory],
// [ErrInvalidArgument], [ErrInvalidFree], [ErrNoDevice], [ErrOutOfRange], [ErrClosed],
// [ErrNotSupported], [ErrNotExportable] and [ErrInvalidIPCHandle] for sharing memory between
// processes, and [ErrMalformedLog] for event logs; a failing driver call is a [*CUDAError], and
// file access reports the operating system's errors (errors.Is(err, fs.ErrNotExist)). A failed
// call leaves the resource or container as it was. A container constructor or operation (fill,
// copy, element access) given a view of a [Stream] that was closed returns [ErrClosed] before
// touching anything; so does an allocation on it from a resource that orders its work on
// streams, and a free on it waits for the device instead of using the destroyed stream (see
// [MemoryResource]).
//
// # The debug log
//
// What is not an error of the call at hand — a container reclaimed without Close (a leak), a pool
// closed with live allocations, a pool's growth (at debug) — is reported through [log/slog] to
// [DebugLogger]: standard error at level warn by default. RMM_DEBUG_LOG_FILE names a file instead
// ("stderr" or "-" for standard error), RMM_DEBUG_LOG_LEVEL sets the level (trace, debug, info,
// warn, error, critical, off; [LevelTrace] and [LevelCritical] are slog levels of their own,
// [LevelOff] writes nothing); [SetDebugLogLevel] and [SetDebugLogFlushLevel] change the level and
// the flush level at run time, [FlushDebugLog] writes out what a file's buffer holds, and
// [SetDebugLogger] replaces the logger.
package rmm
