"""PyTorch's CUDA allocator on the Go pool.

    from gormm_rmm.allocators.torch import rmm_torch_allocator
    torch.cuda.memory.change_current_allocator(rmm_torch_allocator)

rmm_torch_allocator is a torch.cuda.memory.CUDAPluggableAllocator over the library's
rmm_torch_alloc and rmm_free, made at its first use (importing this module does not import
torch). A request the pool refuses raises an error with the library's message (rmm_torch_alloc
throws a std::bad_alloc, which PyTorch raises in Python) rather than giving PyTorch a NULL pointer.
gormm_rmm.use_torch() reinitializes the pool and makes the change in one call.
"""
import threading

from .. import _lib

_lock = threading.Lock()
_allocator = None


def _make():
    global _allocator
    with _lock:
        if _allocator is None:
            try:
                from torch.cuda.memory import CUDAPluggableAllocator
            except ImportError as e:
                raise ModuleNotFoundError("No module named 'torch' (or it has no CUDAPluggableAllocator): %s" % e) from e
            _allocator = CUDAPluggableAllocator(_lib.loaded_path(), "rmm_torch_alloc", "rmm_free")
    return _allocator


def __getattr__(name):
    if name == "rmm_torch_allocator":
        return _make()
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def use(pool="stitching", initial_pool_size=0, maximum_pool_size=0, statistics=False):
    """gormm_rmm.use_torch's body."""
    import torch
    # PyTorch starts its caching allocator when it initialises CUDA, after which
    # change_current_allocator refuses; asking first gives a clearer message and leaves the pool
    # as it was.
    if torch.cuda.is_initialized():
        raise _lib.RMMError(
            "use_torch: PyTorch has already initialised CUDA, and with it its own allocator, which it "
            "cannot swap: call gormm_rmm.use_torch() before the first CUDA tensor or CUDA call")
    _lib.reinitialize(pool=pool, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size,
                      statistics=statistics)
    alloc = _make()
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        if "already initialized" in str(e):
            raise _lib.RMMError("use_torch: PyTorch's allocator is already in use (%s): call "
                                "gormm_rmm.use_torch() before the first CUDA tensor" % e) from e
        raise
    return alloc
