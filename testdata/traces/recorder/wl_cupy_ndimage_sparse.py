"""CuPy image and sparse-matrix pipeline on one thread and one non-blocking stream.

Logged as the CuPy two-thread trace was, by cupy_log.py's logging allocator.
Work: Gaussian/median filtering, labelling and zoom of images of changing size (cupyx.scipy.ndimage),
sparse matrix products and conjugate-gradient solves (cupyx.scipy.sparse), and k-means steps on
point clouds of changing size; a rolling window of recent results stays alive.
"""
import os, random, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cupy as cp
import cupy_log


def work(seed, target, deadline):
    import cupyx.scipy.ndimage as ndi
    import cupyx.scipy.sparse as sp
    import cupyx.scipy.sparse.linalg as spla
    rng = random.Random(seed)
    rs = cp.random.RandomState(seed)
    keep, kinds, i = [], {}, 0
    with cp.cuda.Stream(non_blocking=True) as stream:
        while len(cupy_log.LOG) < target and time.time() < deadline:
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


cupy_log.record("cupy_ndimage_sparse_1stream", lambda: work(33, 110000, time.time() + 60), "1 thread, 1 non-blocking stream; random mix of gaussian filter + label + sum_labels, median filter + zoom, sparse A*A^T + CG, k-means steps; a rolling window of 4-16 recent results stays alive", sys.argv[1])
