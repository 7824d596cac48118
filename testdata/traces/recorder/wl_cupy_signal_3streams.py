"""CuPy signal pipeline on one thread and three non-blocking streams.

Logged as the CuPy two-thread trace was: a logging allocator installed with
cupy.cuda.set_allocator takes memory from a cupy MemoryPool, logs 'allocate', and returns a
MemoryPointer whose owner logs 'free' in __del__ just before the memory goes back to the pool.
Work: a producer stream makes a batch of signals of a size drawn every round and filters it in
the frequency domain; a middle stream, after an event, takes features, a covariance and its
eigenvectors; a reduction stream, after another event, sorts, bins and counts. Arrays are used
on streams other than the one that allocated them, and each round's batch stays alive until the
reduction stream's event has passed (one to four rounds in flight); a window of recent results
stays alive.
"""
import gc, json, os, platform, random, sys, threading, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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


def work(seed, target, deadline):
    rng = random.Random(seed)
    rs = cp.random.RandomState(seed)
    prod, mid, red = (cp.cuda.Stream(non_blocking=True) for _ in range(3))
    inflight, keep, kinds, i = [], [], {}, 0
    while len(LOG) < target and time.time() < deadline:
        # producer stream: a batch of signals of a size drawn every round, spectrum and filter
        n, m = rng.choice([64, 128, 256, 512, 1024]), rng.choice([1024, 4096, 16384, 65536])
        with prod:
            sig = rs.standard_normal((n, m), dtype=cp.float32)
            spec = cp.fft.rfft(sig, axis=1)
            spec *= cp.exp(-cp.arange(spec.shape[1], dtype=cp.float32) / (m / 8.0))
            filt = cp.fft.irfft(spec, n=m, axis=1)
            del sig, spec
            ev = prod.record()
        # middle stream: features and a covariance from the filtered batch, once it is ready
        with mid:
            mid.wait_event(ev)
            k = rng.choice([16, 32, 64, 128])
            feat = filt[:, :k * (m // k)].reshape(n, k, -1).mean(2)
            cov = feat.T @ feat / n
            w, v = cp.linalg.eigh(cov)
            proj = feat @ v[:, -min(8, k):]
            ev2 = mid.record()
        # reduction stream: order statistics of the projections and the raw batch
        with red:
            red.wait_event(ev2)
            srt = cp.sort(proj.ravel())
            q = srt[(cp.arange(1, 10) * srt.size) // 10]
            hist = cp.histogram(filt.ravel()[:min(filt.size, 1 << 20)], bins=rng.choice([64, 256, 1024]))[0]
            u = cp.unique((proj * 100).astype(cp.int32))
            res = cp.concatenate([q, hist[:8].astype(cp.float32), u[:4].astype(cp.float32)])
            ev3 = red.record()
        kinds[(n, m)] = kinds.get((n, m), 0) + 1
        # the batch and its features stay alive until the reduction stream is done with them
        inflight.append((ev3, filt, feat, proj, res))
        del filt, feat, cov, w, v, proj, srt, q, hist, u
        while len(inflight) > rng.randint(1, 4):
            e, *arrs = inflight.pop(0)
            e.synchronize()
            keep.append(arrs[-1])
        if len(keep) > 32:
            keep.pop(rng.randrange(len(keep)))
        i += 1
    for s in (prod, mid, red):
        s.synchronize()
    inflight.clear()
    keep.clear()
    return dict(rounds=i, shapes=len(kinds))


cp.cuda.set_allocator(logging_malloc)
try:
    extra = dict(work=work(35, 110000, time.time() + 60))
except Exception as e:  # keep the partial (still real) trace
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
name = "cupy_signal_3streams_1thread"
text = em.text()
with open(os.path.join(sys.argv[1], name + ".csv"), "w") as f:
    f.write(text)
meta = dict(name=name, source="CuPy logging allocator via cupy.cuda.set_allocator (requested sizes)",
            thread_column="real native thread id", cupy=cp.__version__, python=platform.python_version(),
            gpu=cp.cuda.runtime.getDeviceProperties(DEV)["name"].decode(),
            pool_total_bytes_end=POOL.total_bytes(), wall_s=round(time.time() - T_START, 1), csv_bytes=len(text),
            workload="1 thread, 3 non-blocking streams chained by events: rfft filter / features + covariance + eigh / sort + histogram + unique; batches alive until the last stream is done, 1-4 rounds in flight")
meta.update(extra)
meta.update(em.stats())
with open(os.path.join(sys.argv[1], name + ".json"), "w") as f:
    json.dump(meta, f, indent=1, sort_keys=True)
print("DONE", name, json.dumps({k: meta[k] for k in ("events", "allocate", "free", "never_freed", "unmatched_free_dropped", "double_alloc", "time_clamped")}))
