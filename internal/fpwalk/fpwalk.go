// Package fpwalk takes the calling goroutine's stack by its frame pointers, as the Go runtime's
// execution tracer does (runtime.fpTracebackPCs), at a small fraction of the cost of
// runtime.Callers, whose unwinder decodes tables for every frame. It is written for amd64, where
// Go code keeps frame pointers; elsewhere Callers takes nothing and reports it incomplete.
//
// What it gives. The PCs are the physical return addresses of the frames on the stack: a call
// inlined into its caller has no frame of its own and so no PC, where runtime.Callers gives it
// one, and the wrappers the compiler generates (go and defer statements' closures, methods
// promoted from an embedded field, method values) are not left out, where runtime.Callers elides
// them. runtime.CallersFrames expands the inlined calls of such PCs (it accepts both kinds of
// list); leaving the wrappers out is the caller's business.
//
// Safety. At each frame pointer fp the walk reads two words: the caller's frame pointer at 0(fp)
// and the return address into the caller at 8(fp). It must never read through a frame pointer
// that does not point into mapped memory. A goroutine's frames lie on its own stack, one
// contiguous block that is mapped from the current frame to its top, and the outermost of them
// saved a frame pointer of 0. The chain leaves that stack in one case: Go called back from C
// through cgo (the functions a C program calls in a c-shared library, such as
// cmd/rmm-python's, or callbacks from C libraries). The runtime runs the callback on the
// goroutine's stack, but its outermost frame there (runtime.cgocallbackg's) saved a frame pointer
// into runtime.cgocallback's frame on the thread's system stack (a C thread's stack, or a Go
// thread's g0 stack: another mapping), whose own saved frame pointer is the C caller's register,
// and C code is commonly compiled without frame pointers, using that register for any other
// value. The runtime's frame-pointer unwinders (the execution tracer's, and those of the block
// and mutex profiles) go back to the runtime's unwinder whenever a cgo call or callback is on
// the thread (runtime's m.hasCgoOnStack), which code outside the runtime cannot ask. So this walk
// checks each frame pointer before it reads through it, and stops, reporting the stack
// incomplete, unless the frame pointer is 8-byte aligned, above the previous one (stacks grow
// down, so a caller's frame is above its callee's; this also ends any cycle), at most 1 MiB above
// it, and 16 bytes or more below the top of the running goroutine's stack (its g's stack.hi,
// read through thread-local storage as the runtime's own assembly reads g). The last check keeps
// every read on the goroutine's stack, whatever a C frame left in the register: the chain's step
// off that stack, to cgocallback's frame, fails it. The others keep a walk through a damaged
// chain short. (Goroutine stacks come from the Go heap and system stacks are mapped apart from
// it, so that step almost always fails the 1 MiB bound as well.)
package fpwalk
