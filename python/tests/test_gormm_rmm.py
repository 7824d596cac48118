"""Tests of gormm_rmm that need no GPU, PyTorch or CuPy: the library runs over host memory, and
CuPy and PyTorch are small stand-ins put in sys.modules.

    GORMM_RMM_LIBRARY=/path/to/librmm_go.so python3 -m unittest discover -s python/tests

(cmd/rmm-python's python_test.go builds the library and runs them.)
"""
import ctypes
import gc
import importlib
import os
import sys
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gormm_rmm  # noqa: E402
from gormm_rmm import _lib  # noqa: E402

MiB = 1 << 20
# Small sizes keep the pool's reservation small over host memory.
SIZES = dict(initial_pool_size=64 * MiB, maximum_pool_size=256 * MiB)


class LibraryTest(unittest.TestCase):
    def test_alloc_free_through_ctypes(self):
        gormm_rmm.reinitialize(statistics=True, **SIZES)
        before = gormm_rmm.pool_stats()
        self.assertEqual(before["kind"], "stitching")
        so = ctypes.CDLL(_lib.loaded_path())
        so.rmm_alloc.restype = ctypes.c_void_p
        so.rmm_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        so.rmm_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        ptrs = [so.rmm_alloc(MiB + i, 0, None) for i in range(3)]
        self.assertTrue(all(ptrs), _lib.last_error())
        mid = gormm_rmm.pool_stats()
        self.assertGreaterEqual(mid["live_bytes"], before["live_bytes"] + 3 * MiB)
        self.assertEqual(mid["live_allocations"], before["live_allocations"] + 3)
        self.assertGreaterEqual(mid["peak_pool_size"], mid["pool_size"])
        gormm_rmm.check_pool()
        for i, p in enumerate(ptrs):
            so.rmm_free(p, MiB + i, 0, None)
        after = gormm_rmm.pool_stats()
        self.assertEqual(after["live_bytes"], before["live_bytes"])
        self.assertEqual(after["live_allocations"], before["live_allocations"])
        st = gormm_rmm.statistics()
        self.assertEqual(st["total_count"], 3)
        self.assertEqual(st["current_bytes"], 0)
        self.assertEqual(st["peak_count"], 3)
        gormm_rmm.check_pool()
        self.assertEqual(so.rmm_alloc(0, 0, None), None)  # 0 bytes: NULL, nothing counted
        self.assertEqual(gormm_rmm.statistics()["total_count"], 3)

    def test_kinds(self):
        for kind in ("plain", "expandable", "stitching"):
            gormm_rmm.reinitialize(pool=kind, **SIZES)
            st = gormm_rmm.pool_stats()
            self.assertEqual(st["kind"], kind)
            if kind == "plain":
                self.assertEqual(st["vmm_creates"] + st["vmm_maps"], 0)
            else:
                self.assertGreater(st["vmm_creates"], 0)
            self.assertEqual(set(st), set(_lib.POOL_STATS_FIELDS))
            self.assertEqual(_lib.lib().rmm_pool_stats_len(), len(_lib.POOL_STATS_FIELDS))

    def test_bad_arguments(self):
        for bad in ("default", "Stitching", 1, True):
            with self.assertRaises(ValueError):
                gormm_rmm.reinitialize(pool=bad)
        with self.assertRaises(ValueError):
            gormm_rmm.reinitialize(initial_pool_size=-1)
        with self.assertRaises(ValueError):
            gormm_rmm.reinitialize(maximum_pool_size="1GiB")
        for kw, says in ((dict(initial_pool_size=1000), "multiple of 256"),
                         (dict(pool=None, initial_pool_size=MiB), "only used with a pool"),
                         (dict(initial_pool_size=4 * MiB, maximum_pool_size=MiB), "exceeds maximum_pool_size")):
            with self.assertRaises(ValueError) as cm:
                gormm_rmm.reinitialize(**kw)
            self.assertIn(says, str(cm.exception))

    def test_library_errors(self):
        with self.assertRaises(gormm_rmm.RMMError) as cm:
            gormm_rmm.reinitialize(pool="plain", initial_pool_size=1 << 60)
        self.assertIn("out of memory", str(cm.exception))
        self.assertEqual(str(cm.exception), gormm_rmm.last_error())
        gormm_rmm.reinitialize(pool=None)
        with self.assertRaises(gormm_rmm.RMMError) as cm:
            gormm_rmm.pool_stats()
        self.assertIn("no pool under device 0's resource", str(cm.exception))
        with self.assertRaises(gormm_rmm.RMMError) as cm:
            gormm_rmm.statistics()
        self.assertIn("counts nothing", str(cm.exception))
        gormm_rmm.reinitialize(**SIZES)
        with self.assertRaises(gormm_rmm.RMMError) as cm:
            _lib.alloc(1 << 40)
        self.assertIn("out of memory", str(cm.exception))

    def test_library_path(self):
        self.assertEqual(_lib.library_path(), os.path.abspath(os.environ[_lib.LIBRARY_ENV]))
        old = os.environ[_lib.LIBRARY_ENV]
        try:
            os.environ[_lib.LIBRARY_ENV] = old + ".absent"
            with self.assertRaises(gormm_rmm.RMMError):
                _lib.library_path()
        finally:
            os.environ[_lib.LIBRARY_ENV] = old


def fake_cupy(stream_ptr, device_id):
    """A stand-in for the parts of CuPy rmm_cupy_allocator uses."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    memory = types.ModuleType("cupy.cuda.memory")

    class OutOfMemoryError(MemoryError):  # CuPy's constructor
        def __init__(self, size, total, limit=0):
            super().__init__("Out of memory allocating {:,} bytes (allocated so far: {:,} bytes).".format(size, total))

    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id=-1):
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

    class Device:
        def __init__(self, device=None):
            self.id = device_id if device is None else device

    state = types.SimpleNamespace(stream=Stream(stream_ptr), allocator=None)
    memory.OutOfMemoryError, memory.UnownedMemory, memory.MemoryPointer = OutOfMemoryError, UnownedMemory, MemoryPointer
    cuda.memory, cuda.Device, cuda.Stream = memory, Device, Stream
    cuda.get_current_stream = lambda: state.stream
    cuda.set_allocator = lambda a=None: setattr(state, "allocator", a)
    cupy.cuda = cuda
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.memory": memory}, state


class Recorder:
    """Wraps the loaded library, recording the calls of rmm_alloc and rmm_free."""

    def __init__(self, so):
        self.so, self.calls = so, []

    def __getattr__(self, name):
        return getattr(self.so, name)

    def rmm_alloc(self, size, device, stream):
        p = self.so.rmm_alloc(size, device, stream)
        self.calls.append(("alloc", size, device, stream, p))
        return p

    def rmm_free(self, ptr, size, device, stream):
        self.calls.append(("free", size, device, stream, ptr))
        self.so.rmm_free(ptr, size, device, stream)


class CupyAllocatorTest(unittest.TestCase):
    # Stream handle 1 is CU_STREAM_LEGACY, which the library takes over host memory too: a value
    # other than 0 shows that the current stream's handle is what is passed.
    STREAM = 1

    def setUp(self):
        modules, self.state = fake_cupy(self.STREAM, 0)
        self.saved = {k: sys.modules.get(k) for k in modules}
        sys.modules.update(modules)
        sys.modules.pop("gormm_rmm.allocators.cupy", None)
        self.mod = importlib.import_module("gormm_rmm.allocators.cupy")
        self.rec = Recorder(_lib.lib())
        self.real, _lib._lib = _lib._lib, self.rec

    def tearDown(self):
        _lib._lib = self.real
        sys.modules.pop("gormm_rmm.allocators.cupy", None)
        for k, v in self.saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v

    def test_allocate_and_free_on_collection(self):
        gormm_rmm.use_cupy(statistics=True, **SIZES)
        self.assertIs(self.state.allocator, self.mod.rmm_cupy_allocator)
        before = gormm_rmm.pool_stats()
        mp = self.mod.rmm_cupy_allocator(3 * MiB)
        self.assertTrue(mp.ptr)
        self.assertEqual(mp.mem.size, 3 * MiB)
        self.assertEqual(mp.mem.device_id, 0)
        self.assertEqual(self.rec.calls, [("alloc", 3 * MiB, 0, self.STREAM, mp.ptr)])
        self.assertEqual(gormm_rmm.pool_stats()["live_allocations"], before["live_allocations"] + 1)
        # Another current stream for the next allocation: its free must still use the first's.
        self.state.stream = sys.modules["cupy"].cuda.Stream(0)
        mp2 = self.mod.rmm_cupy_allocator(MiB)
        ptr = mp.ptr
        del mp
        gc.collect()
        self.assertEqual(self.rec.calls[-1], ("free", 3 * MiB, 0, self.STREAM, ptr))
        self.assertEqual(gormm_rmm.pool_stats()["live_allocations"], before["live_allocations"] + 1)
        ptr2 = mp2.ptr
        del mp2
        gc.collect()
        self.assertEqual(self.rec.calls[-1], ("free", MiB, 0, 0, ptr2))
        after = gormm_rmm.pool_stats()
        self.assertEqual((after["live_bytes"], after["live_allocations"]),
                         (before["live_bytes"], before["live_allocations"]))
        self.assertEqual(gormm_rmm.statistics()["total_count"], 2)
        gormm_rmm.check_pool()

    def test_zero_bytes(self):
        gormm_rmm.reinitialize(**SIZES)
        mp = self.mod.rmm_cupy_allocator(0)
        self.assertEqual((mp.ptr, mp.mem.size, mp.mem.device_id), (0, 0, 0))
        del mp
        gc.collect()
        self.assertEqual(self.rec.calls, [])

    def test_out_of_memory(self):
        gormm_rmm.reinitialize(**SIZES)
        oom = sys.modules["cupy"].cuda.memory.OutOfMemoryError
        with self.assertRaises(oom) as cm:
            self.mod.rmm_cupy_allocator(1 << 40)
        msg = str(cm.exception)
        self.assertIn("Out of memory allocating 1,099,511,627,776 bytes", msg)
        self.assertIn("exceeds the maximum pool size", msg)
        self.assertIsInstance(cm.exception.__cause__, gormm_rmm.RMMError)

    def test_other_failure(self):
        gormm_rmm.reinitialize(**SIZES)
        self.state.stream = sys.modules["cupy"].cuda.Stream(0)
        with self.assertRaises(gormm_rmm.RMMError):
            # A negative device: refused by the library, not an out-of-memory error.
            self.mod.cupy.cuda.Device = lambda: types.SimpleNamespace(id=-1)
            self.mod.rmm_cupy_allocator(MiB)


def fake_torch(initialized):
    torch = types.ModuleType("torch")
    cuda = types.ModuleType("torch.cuda")
    memory = types.ModuleType("torch.cuda.memory")
    state = types.SimpleNamespace(current=None, made=[])

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc_fn_name, free_fn_name):
            state.made.append((path, alloc_fn_name, free_fn_name))

    def change_current_allocator(a):
        if initialized:
            raise RuntimeError("Can't swap an already initialized allocator")
        state.current = a

    memory.CUDAPluggableAllocator, memory.change_current_allocator = CUDAPluggableAllocator, change_current_allocator
    cuda.memory, cuda.is_initialized = memory, (lambda: initialized)
    torch.cuda = cuda
    return {"torch": torch, "torch.cuda": cuda, "torch.cuda.memory": memory}, state


class TorchAllocatorTest(unittest.TestCase):
    def run_with(self, initialized, fn):
        modules, state = fake_torch(initialized)
        saved = {k: sys.modules.get(k) for k in modules}
        sys.modules.update(modules)
        sys.modules.pop("gormm_rmm.allocators.torch", None)
        try:
            return fn(state)
        finally:
            sys.modules.pop("gormm_rmm.allocators.torch", None)
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v

    def test_use_torch(self):
        def body(state):
            a = gormm_rmm.use_torch(pool="expandable", **SIZES)
            self.assertIs(state.current, a)
            self.assertEqual(state.made, [(_lib.loaded_path(), "rmm_torch_alloc", "rmm_free")])
            from gormm_rmm.allocators.torch import rmm_torch_allocator
            self.assertIs(rmm_torch_allocator, a)
            self.assertEqual(gormm_rmm.pool_stats()["kind"], "expandable")
        self.run_with(False, body)

    def test_use_torch_too_late(self):
        def body(state):
            gormm_rmm.reinitialize(pool="plain", **SIZES)
            with self.assertRaises(gormm_rmm.RMMError) as cm:
                gormm_rmm.use_torch()
            self.assertIn("before the first CUDA tensor", str(cm.exception))
            self.assertIsNone(state.current)
            self.assertEqual(gormm_rmm.pool_stats()["kind"], "plain")  # left as it was
        self.run_with(True, body)


if __name__ == "__main__":
    unittest.main()
