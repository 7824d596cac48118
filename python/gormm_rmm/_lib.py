"""The ctypes binding to librmm_go.so (built from cmd/rmm-python)."""
import ctypes
import os
import threading

LIBRARY_ENV = "GORMM_RMM_LIBRARY"
LIBRARY_NAME = "librmm_go.so"

# The pool kinds in the order of the numbers rmm_reinitialize and rmm_pool_stats use (1, 2, 3).
POOL_KINDS = ("stitching", "expandable", "plain")

STATISTICS_FIELDS = ("current_bytes", "current_count", "peak_bytes", "peak_count", "total_bytes", "total_count")
POOL_STATS_FIELDS = ("pool_size", "peak_pool_size", "live_bytes", "live_allocations", "kind",
                     "vmm_creates", "vmm_maps", "vmm_unmaps", "vmm_releases", "stitched_ranges",
                     "maximum_pool_size", "free_bytes", "vmm_set_access", "vmm_reserves",
                     "address_reserved", "stitched_kept", "stitched_evicted")


class RMMError(RuntimeError):
    """A call into the Go library failed; the message is the library's (rmm_last_error)."""


_lock = threading.Lock()
_lib = None
_path = None


def library_path():
    """The library this package loads: $GORMM_RMM_LIBRARY, else the copy installed with it."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        if not os.path.isfile(env):
            raise RMMError("%s=%s: no such file" % (LIBRARY_ENV, env))
        return os.path.abspath(env)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)
    if os.path.isfile(here):
        return here
    raise RMMError(
        "gormm_rmm was installed without %s (Go or a C or C++ compiler was missing when it was built): "
        "build it with `go build -buildmode=c-shared -o %s ./cmd/rmm-python` in the repository "
        "and set %s to its path, or reinstall the package where Go is on the PATH"
        % (LIBRARY_NAME, LIBRARY_NAME, LIBRARY_ENV))


def lib():
    """The loaded library, with its functions' types set (loaded once per process)."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            path = library_path()
            so = ctypes.CDLL(path)
            so.rmm_alloc.restype = ctypes.c_void_p
            so.rmm_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            so.rmm_free.restype = None
            so.rmm_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            so.rmm_last_error.restype = ctypes.c_char_p
            so.rmm_last_error.argtypes = []
            so.rmm_reinitialize.restype = ctypes.c_int
            so.rmm_reinitialize.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
            so.rmm_statistics.restype = ctypes.c_int
            so.rmm_statistics.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong)]
            so.rmm_pool_stats.restype = ctypes.c_int
            so.rmm_pool_stats.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong)]
            so.rmm_pool_stats_len.restype = ctypes.c_int
            so.rmm_pool_stats_len.argtypes = []
            so.rmm_check_pool.restype = ctypes.c_int
            so.rmm_check_pool.argtypes = [ctypes.c_int]
            _path = path
            _lib = so
    return _lib


def loaded_path():
    """The path of the loaded library (loading it if it is not yet)."""
    lib()
    return _path


def last_error():
    """The message of the calling thread's last failing call into the library ('' if none)."""
    msg = lib().rmm_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def _fail(what):
    return RMMError(last_error() or ("%s failed" % what))


def alloc(nbytes, device=0, stream=0):
    """nbytes from device's resource, ordered on the stream whose handle is stream (0: the legacy
    default stream); 0 for 0 bytes. Raises RMMError with the library's message on failure."""
    if nbytes < 0:
        raise ValueError("alloc: nbytes %d < 0" % nbytes)
    if nbytes == 0:
        return 0
    p = lib().rmm_alloc(nbytes, device, stream)
    if not p:
        raise _fail("rmm_alloc(%d, %d, %#x)" % (nbytes, device, stream))
    return p


def free(ptr, nbytes, device=0, stream=0):
    """Gives back what alloc returned, with the same size and device, ordered on stream. The
    library reports a failed free only through last_error; this call does not raise."""
    if ptr:
        lib().rmm_free(ptr, nbytes, device, stream)


def reinitialize(pool="stitching", initial_pool_size=0, maximum_pool_size=0, statistics=False):
    """Sets up device 0's resource, as rmm.reinitialize does: a pool of the kind named
    ("stitching", the default; "expandable"; "plain", librmm's) or none (None), of the given
    initial and maximum sizes in bytes (0: the library's defaults; sizes without a pool are an
    error), counting its allocations if statistics is true."""
    if pool is None:
        n = 0
    elif isinstance(pool, str) and pool in POOL_KINDS:
        n = POOL_KINDS.index(pool) + 1
    else:
        raise ValueError("reinitialize: pool=%r: want one of %s or None" % (pool, ", ".join(map(repr, POOL_KINDS))))
    for name, v in (("initial_pool_size", initial_pool_size), ("maximum_pool_size", maximum_pool_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError("reinitialize: %s=%r: want a size in bytes (an int >= 0)" % (name, v))
        if v % 256:
            raise ValueError("reinitialize: %s=%d: want a multiple of 256 bytes" % (name, v))
        if v and pool is None:
            raise ValueError("reinitialize: %s=%d: sizes are only used with a pool (pool=None)" % (name, v))
    if maximum_pool_size and initial_pool_size > maximum_pool_size:
        raise ValueError("reinitialize: initial_pool_size=%d exceeds maximum_pool_size=%d" % (initial_pool_size, maximum_pool_size))
    if lib().rmm_reinitialize(n, initial_pool_size, maximum_pool_size, 1 if statistics else 0) != 0:
        raise _fail("rmm_reinitialize")


def statistics(device=0):
    """The statistics adaptor's counts (reinitialize(statistics=True) makes one) as a dict:
    current, peak and total bytes and counts."""
    out = (ctypes.c_longlong * len(STATISTICS_FIELDS))()
    if lib().rmm_statistics(device, out) != 0:
        raise _fail("rmm_statistics")
    return dict(zip(STATISTICS_FIELDS, list(out)))


def pool_stats(device=0):
    """The figures of the pool under device's resource as a dict: pool_size, peak_pool_size,
    live_bytes, live_allocations, kind ("stitching", "expandable" or "plain") and the driver calls
    of an expandable or stitching pool (vmm_creates, vmm_maps, vmm_unmaps, vmm_releases,
    stitched_ranges, vmm_set_access, vmm_reserves, address_reserved in bytes, stitched_kept,
    stitched_evicted; 0 for a plain pool), maximum_pool_size and free_bytes."""
    so = lib()
    # The library says how many values it writes, so that a newer one that appends more never
    # writes past the array.
    n = max(so.rmm_pool_stats_len(), len(POOL_STATS_FIELDS))
    out = (ctypes.c_longlong * n)()
    if so.rmm_pool_stats(device, out) != 0:
        raise _fail("rmm_pool_stats")
    d = dict(zip(POOL_STATS_FIELDS, list(out)))
    k = d["kind"]
    d["kind"] = POOL_KINDS[k - 1] if 1 <= k <= len(POOL_KINDS) else "unknown(%d)" % k
    return d


def check_pool(device=0):
    """Runs the pool's invariant checks; raises RMMError saying what is wrong, if anything."""
    if lib().rmm_check_pool(device) != 0:
        raise _fail("rmm_check_pool")
