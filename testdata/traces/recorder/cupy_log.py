"""Recording helpers of the CuPy recorders (wl_cupy_*.py): a logging allocator and the writer.

The allocator, installed with cupy.cuda.set_allocator by record, takes memory from a cupy
MemoryPool, logs 'allocate', and returns a MemoryPointer whose owner logs 'free' in __del__ just
before the memory goes back to the pool (as the two-thread CuPy trace was recorded). record then
writes the log as an RMM CSV (rmmcsv.py) with a JSON of facts beside it.
"""
import gc, json, os, platform, threading, time
import cupy as cp
import rmmcsv

LOG = []  # (tid, t_ns, kind, ptr, size, stream)
LOCK = threading.RLock()  # re-entrant: a GC-triggered __del__ may log while we log
POOL = cp.cuda.MemoryPool()
DEV = cp.cuda.Device().id
T_START = time.time()


class _Owner:
    __slots__ = ("mp", "ptr", "size", "stream")

    def __init__(self, mp, size, stream):
        self.mp, self.ptr, self.size, self.stream = mp, mp.ptr, size, stream

    def __del__(self):
        with LOCK:
            LOG.append((threading.get_native_id(), time.perf_counter_ns(), "F", self.ptr, self.size, self.stream))


def logging_malloc(size):
    mp = POOL.malloc(size)
    if size == 0 or mp.ptr == 0:
        return mp
    stream = cp.cuda.get_current_stream().ptr
    owner = _Owner(mp, size, stream)
    with LOCK:
        LOG.append((threading.get_native_id(), time.perf_counter_ns(), "A", mp.ptr, size, stream))
    return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(mp.ptr, size, owner, DEV), 0)


def record(name, work, workload, outdir):
    """Runs work() (it returns a dict of facts) with the logging allocator installed, then writes
    outdir/name.csv and outdir/name.json. An exception in work keeps the partial (still real)
    trace and is noted in the JSON."""
    cp.cuda.set_allocator(logging_malloc)
    try:
        extra = dict(work=work())
    except Exception as e:
        import traceback; traceback.print_exc()
        extra = dict(error=repr(e)[:300])
    gc.collect()
    cp.cuda.Device().synchronize()
    with LOCK:
        log = list(LOG)
    em = rmmcsv.Emitter()
    for tid, tns, kind, ptr, size, stream in log:
        if kind == "A":
            em.alloc(tid, tns // 1000, ptr, size, stream)
        else:
            em.free(tid, tns // 1000, ptr, size)
    text = em.text()
    with open(os.path.join(outdir, name + ".csv"), "w") as f:
        f.write(text)
    meta = dict(name=name, source="CuPy logging allocator via cupy.cuda.set_allocator (requested sizes)",
                thread_column="real native thread id", cupy=cp.__version__, python=platform.python_version(),
                gpu=cp.cuda.runtime.getDeviceProperties(DEV)["name"].decode(),
                pool_total_bytes_end=POOL.total_bytes(), wall_s=round(time.time() - T_START, 1), csv_bytes=len(text),
                workload=workload)
    meta.update(extra)
    meta.update(em.stats())
    with open(os.path.join(outdir, name + ".json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    print("DONE", name, json.dumps({k: meta[k] for k in ("events", "allocate", "free", "never_freed", "unmatched_free_dropped", "double_alloc", "time_clamped")}))
