"""gormm_rmm: the Go RAPIDS Memory Manager's pool under PyTorch and CuPy.

    import gormm_rmm
    gormm_rmm.use_torch()   # PyTorch's CUDA tensors come from the Go pool (before the first one)
    gormm_rmm.use_cupy()    # CuPy's arrays too

The package loads librmm_go.so (cmd/rmm-python in the Go repository) with ctypes: the copy pip
built and installed with it, or the one $GORMM_RMM_LIBRARY names.
"""
from ._lib import (LIBRARY_ENV, POOL_KINDS, RMMError, check_pool, last_error, library_path, loaded_path,
                   pool_stats, reinitialize, statistics)

__all__ = ["RMMError", "reinitialize", "pool_stats", "statistics", "check_pool", "last_error", "library_path",
           "loaded_path", "use_torch", "use_cupy", "POOL_KINDS", "LIBRARY_ENV"]
__version__ = "0.1.0"


def use_torch(pool="stitching", initial_pool_size=0, maximum_pool_size=0, statistics=False):
    """Reinitializes the Go pool (see reinitialize) and makes it PyTorch's CUDA allocator; returns
    the allocator. Call it before PyTorch's first CUDA allocation: PyTorch cannot change an
    allocator it has started, and this raises RMMError if it has."""
    from .allocators import torch as _t
    return _t.use(pool=pool, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size,
                  statistics=statistics)


def use_cupy(pool="stitching", initial_pool_size=0, maximum_pool_size=0, statistics=False):
    """Reinitializes the Go pool (see reinitialize) and makes rmm_cupy_allocator CuPy's allocator
    (cupy.cuda.set_allocator); returns the allocator."""
    from .allocators import cupy as _c
    return _c.use(pool=pool, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size,
                  statistics=statistics)
