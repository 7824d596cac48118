"""CuPy's allocator on the Go pool.

    from gormm_rmm.allocators.cupy import rmm_cupy_allocator
    cupy.cuda.set_allocator(rmm_cupy_allocator)

Each allocation comes from the current device's resource, ordered on CuPy's current stream; the
memory goes back, on that stream and device, when CuPy drops its last reference to it.
gormm_rmm.use_cupy() reinitializes the pool and makes the change in one call.
"""
from .. import _lib

try:
    import cupy
except ImportError:
    cupy = None


class _Buffer:
    """The owner of one allocation, as RMM's DeviceBuffer is for rmm_cupy_allocator: it frees the
    memory when CuPy's UnownedMemory lets it go."""

    __slots__ = ("ptr", "size", "device", "stream", "_stream_obj", "__weakref__")

    def __init__(self, ptr, size, device, stream, stream_obj):
        self.ptr, self.size, self.device, self.stream = ptr, size, device, stream
        # The free is ordered on this stream: holding CuPy's object keeps a stream CuPy created
        # alive until then.
        self._stream_obj = stream_obj

    def __del__(self):
        ptr, self.ptr = self.ptr, 0
        if ptr:
            _lib.free(ptr, self.size, self.device, self.stream)
        self._stream_obj = None


def _out_of_memory(nbytes, msg):
    try:
        total = _lib.pool_stats(0)["live_bytes"]
    except Exception:
        total = 0
    err = cupy.cuda.memory.OutOfMemoryError(nbytes, total)
    # CuPy's constructor writes its own message; the library's says why.
    err.args = ("%s %s" % (err.args[0] if err.args else "", msg),)
    return err


def rmm_cupy_allocator(nbytes):
    """A CuPy allocator (cupy.cuda.set_allocator) that allocates from the Go pool.

    >>> from gormm_rmm.allocators.cupy import rmm_cupy_allocator
    >>> import cupy
    >>> cupy.cuda.set_allocator(rmm_cupy_allocator)
    """
    if cupy is None:
        raise ModuleNotFoundError("No module named 'cupy'")
    stream = cupy.cuda.get_current_stream()
    sptr = int(stream.ptr)
    dev = cupy.cuda.Device().id
    ptr = 0
    if nbytes > 0:
        # As RMM's DeviceBuffer of size 0, a request of 0 bytes gets a null pointer, without a
        # call into the library.
        ptr = _lib.lib().rmm_alloc(nbytes, dev, sptr) or 0
        if not ptr:
            msg = _lib.last_error() or "rmm_alloc(%d) failed" % nbytes
            if "out of memory" in msg:
                raise _out_of_memory(nbytes, msg) from _lib.RMMError(msg)
            raise _lib.RMMError(msg)
    buf = _Buffer(ptr, nbytes, dev, sptr, stream)
    mem = cupy.cuda.memory.UnownedMemory(ptr, nbytes, buf, dev)
    return cupy.cuda.memory.MemoryPointer(mem, 0)


def use(pool="stitching", initial_pool_size=0, maximum_pool_size=0, statistics=False):
    """gormm_rmm.use_cupy's body."""
    if cupy is None:
        raise ModuleNotFoundError("No module named 'cupy'")
    _lib.reinitialize(pool=pool, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size,
                      statistics=statistics)
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    return rmm_cupy_allocator
