"""CuPy image and sparse-matrix pipeline on one thread and one non-blocking stream.

Logged as the CuPy two-thread trace was: a logging allocator installed with
cupy.cuda.set_allocator takes memory from a cupy MemoryPool, logs 'allocate', and returns a
MemoryPointer whose owner logs 'free' in __del__ just before the memory goes back to the pool.
Work: Gaussian/median filtering, labelling and zoom of images of changing size (cupyx.scipy.ndimage),
sparse matrix products and conjugate-gradient solves (cupyx.scipy.sparse), and k-means steps on
point clouds of changing size; a rolling window of recent results stays alive.
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
    import cupyx.scipy.ndimage as ndi
    import cupyx.scipy.sparse as sp
    import cupyx.scipy.sparse.linalg as spla
    rng = random.Random(seed)
    rs = cp.random.RandomState(seed)
    keep, kinds, i = [], {}, 0
    with cp.cuda.Stream(non_blocking=True) as stream:
        while len(LOG) < target and time.time() < deadline:
            r = rng.random()
            if r < 0.3:
                k = "filter_label"
                h, w = rng.randint(200, 3000), rng.randint(200, 3000)
                img = rs.random_sample((h, w), dtype=cp.float32)
                g = ndi.gaussian_filter(img, sigma=rng.uniform(0.5, 4.0))
                lab, n = ndi.label(g > g.mean() + 0.05)
                res = ndi.sum_labels(g, lab, cp.arange(1, min(int(n), 64) + 1))
            elif r < 0.45:
                k = "median_zoom"
                h, w = rng.randint(64, 1024), rng.randint(64, 1024)
                img = rs.random_sample((h, w), dtype=cp.float32)
                m = ndi.median_filter(img, size=rng.choice([3, 5]))
                res = ndi.zoom(m, rng.uniform(0.5, 2.0), order=1).mean(keepdims=True)
            elif r < 0.75:
                k = "sparse_cg"
                n = rng.randint(1000, 200000)
                nnz = n * rng.randint(3, 20)
                rows = rs.randint(0, n, nnz)
                cols = rs.randint(0, n, nnz)
                vals = rs.random_sample(nnz, dtype=cp.float32)
                a = sp.coo_matrix((vals, (rows, cols)), shape=(n, n)).tocsr()
                spd = a @ a.T + sp.identity(n, dtype=cp.float32, format="csr") * float(n) ** 0.5
                b = rs.random_sample(n, dtype=cp.float32)
                x, _ = spla.cg(spd, b, maxiter=rng.randint(5, 30))
                res = cp.linalg.norm(spd @ x - b, keepdims=True)
            else:
                k = "kmeans"
                n, d, c = rng.randint(10000, 1000000), rng.choice([2, 3, 8, 16, 32]), rng.randint(4, 64)
                pts = rs.standard_normal((n, d), dtype=cp.float32)
                cen = pts[:c].copy()
                for _ in range(rng.randint(2, 8)):
                    d2 = (pts * pts).sum(1, keepdims=True) - 2 * pts @ cen.T + (cen * cen).sum(1)
                    lab = d2.argmin(1)
                    cnt = cp.bincount(lab, minlength=c).astype(cp.float32)
                    s = cp.zeros((c, d), dtype=cp.float32)
                    cp.add.at(s, lab, pts)
                    cen = s / cp.maximum(cnt, 1)[:, None]
                res = cen
            kinds[k] = kinds.get(k, 0) + 1
            keep.append(res)
            if len(keep) > rng.randint(4, 16):
                keep.pop(rng.randrange(len(keep)))
            i += 1
        stream.synchronize()
        keep.clear()
    return dict(batches=i, kinds=kinds)


cp.cuda.set_allocator(logging_malloc)
try:
    extra = dict(work=work(33, 110000, time.time() + 60))
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
name = "cupy_ndimage_sparse_1stream"
text = em.text()
with open(os.path.join(sys.argv[1], name + ".csv"), "w") as f:
    f.write(text)
meta = dict(name=name, source="CuPy logging allocator via cupy.cuda.set_allocator (requested sizes)",
            thread_column="real native thread id", cupy=cp.__version__, python=platform.python_version(),
            gpu=cp.cuda.runtime.getDeviceProperties(DEV)["name"].decode(),
            pool_total_bytes_end=POOL.total_bytes(), wall_s=round(time.time() - T_START, 1), csv_bytes=len(text),
            workload="1 thread, 1 non-blocking stream; random mix of gaussian filter + label + sum_labels, median filter + zoom, sparse A*A^T + CG, k-means steps; a rolling window of 4-16 recent results stays alive")
meta.update(extra)
meta.update(em.stats())
with open(os.path.join(sys.argv[1], name + ".json"), "w") as f:
    json.dump(meta, f, indent=1, sort_keys=True)
print("DONE", name, json.dumps({k: meta[k] for k in ("events", "allocate", "free", "never_freed", "unmatched_free_dropped", "double_alloc", "time_clamped")}))
