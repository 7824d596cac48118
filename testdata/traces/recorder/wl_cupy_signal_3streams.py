"""CuPy signal pipeline on one thread and three non-blocking streams.

Logged as the CuPy two-thread trace was, by cupy_log.py's logging allocator.
Work: a producer stream makes a batch of signals of a size drawn every round and filters it in
the frequency domain; a middle stream, after an event, takes features, a covariance and its
eigenvectors; a reduction stream, after another event, sorts, bins and counts. Arrays are used
on streams other than the one that allocated them, and each round's batch stays alive until the
reduction stream's event has passed (one to four rounds in flight); a window of recent results
stays alive.
"""
import os, random, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cupy as cp
import cupy_log


def work(seed, target, deadline):
    rng = random.Random(seed)
    rs = cp.random.RandomState(seed)
    prod, mid, red = (cp.cuda.Stream(non_blocking=True) for _ in range(3))
    inflight, keep, kinds, i = [], [], {}, 0
    while len(cupy_log.LOG) < target and time.time() < deadline:
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


cupy_log.record("cupy_signal_3streams_1thread", lambda: work(35, 110000, time.time() + 60), "1 thread, 3 non-blocking streams chained by events: rfft filter / features + covariance + eigh / sort + histogram + unique; batches alive until the last stream is done, 1-4 rounds in flight", sys.argv[1])
