"""Check that librmm_go.so serves PyTorch as its CUDA allocator, beside PyTorch's own.

    go build -buildmode=c-shared -o librmm_go.so ./cmd/rmm-python
    python3 cmd/rmm-python/torch_check.py ./librmm_go.so [--steps 30]

It runs the same seeded work twice, each in a process of its own: once on PyTorch's caching
allocator, once with the Go pool as PyTorch's allocator (CUDAPluggableAllocator, set before the
first CUDA tensor). The work: training steps of a small ResNet-style network on random images,
then a side-stream pipeline whose tensors are made on other streams and freed after the default
stream has used them (each side stream waits on the default one before its tensors go). It prints
one JSON object: the losses of both runs (which must be equal), the median time per training
step of each, and for the Go run the allocations the pool counted, what PyTorch's native pool
reserved (must be 0) and the pool's state at the end (its figures, and its CheckInvariants). Exit status 1 when a check fails.
"""
import argparse, ctypes, json, os, statistics, subprocess, sys, time


def work(steps):
    import torch
    import torch.nn as nn
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True

    def block(ci, co, stride):
        return nn.Sequential(nn.Conv2d(ci, co, 3, stride, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU(),
                             nn.Conv2d(co, co, 3, 1, 1, bias=False), nn.BatchNorm2d(co), nn.ReLU())

    model = nn.Sequential(block(3, 32, 1), block(32, 64, 2), block(64, 128, 2), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(128, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses, times = [], []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = torch.randn(64, 3, 64, 64, device="cuda", generator=g)
        y = torch.randint(0, 10, (64,), device="cuda", generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    # Tensors made on side streams, used on the default stream, freed after it.
    side = [torch.cuda.Stream() for _ in range(3)]
    acc = torch.zeros(1024, 1024, device="cuda")
    for i in range(60):
        s = side[i % 3]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            t = torch.randn(1024, 1024, device="cuda", generator=g) * (i + 1)
            u = t @ t.T
        torch.cuda.current_stream().wait_stream(s)
        acc += u.sum(0, keepdim=True) / 1e6
        s.wait_stream(torch.cuda.current_stream())  # the default stream's use is over before t, u go
        del t, u
    losses.append(float(acc.sum().item()))
    torch.cuda.synchronize()
    del model, opt, x, y, loss, acc
    import gc
    gc.collect()
    torch.cuda.synchronize()
    return losses, statistics.median(times[2:]) if len(times) > 3 else statistics.median(times)


def child(mode, lib, steps):
    import torch
    out = {"mode": mode}
    if mode == "go":
        so = ctypes.CDLL(lib)
        so.rmm_last_error.restype = ctypes.c_char_p
        so.rmm_reinitialize.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
        if so.rmm_reinitialize(1, 0, 0, 1) != 0:
            raise SystemExit("rmm_reinitialize: %s" % so.rmm_last_error())
        alloc = torch.cuda.memory.CUDAPluggableAllocator(lib, "rmm_torch_alloc", "rmm_free")
        torch.cuda.memory.change_current_allocator(alloc)
    losses, step = work(steps)
    out["losses"], out["step_s"] = losses, step
    if mode == "go":
        st, ps = (ctypes.c_longlong * 6)(), (ctypes.c_longlong * so.rmm_pool_stats_len())()
        so.rmm_statistics(0, st)
        so.rmm_pool_stats(0, ps)
        out["go_statistics"] = dict(zip(["current_bytes", "current_count", "peak_bytes", "peak_count", "total_bytes", "total_count"], list(st)))
        out["go_pool"] = dict(zip(["pool_size", "peak_pool_size", "live_bytes", "live_allocations", "kind",
                                   "vmm_creates", "vmm_maps", "vmm_unmaps", "vmm_releases", "stitched_ranges"], list(ps)))
        so.rmm_last_error.restype = ctypes.c_char_p
        ok = so.rmm_check_pool(0) == 0
        out["go_pool_invariants"] = "hold" if ok else (so.rmm_last_error() or b"").decode()
    try:
        out["torch_native_reserved"] = torch.cuda.memory_reserved()
    except Exception as e:  # the pluggable allocator has no native statistics
        out["torch_native_reserved"] = 0
        out["torch_native_reserved_note"] = repr(e)[:200]
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--child")
    a = ap.parse_args()
    lib = os.path.abspath(a.lib)
    if a.child:
        child(a.child, lib, a.steps)
        return
    runs = {}
    for mode in ("native", "go"):
        r = subprocess.run([sys.executable, __file__, lib, "--steps", str(a.steps), "--child", mode],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            raise SystemExit("the %s run failed" % mode)
        runs[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    n, g = runs["native"], runs["go"]
    st = g["go_statistics"]
    checks = {
        "losses equal": n["losses"] == g["losses"],
        "the pool served allocations": st["total_count"] > 0,
        "PyTorch's native pool unused": g["torch_native_reserved"] == 0,
        "the pool holds what the statistics count live": g["go_pool"]["live_bytes"] >= st["current_bytes"] >= 0,
        "the pool's invariants hold at the end": g["go_pool_invariants"] == "hold",
    }
    result = {"checks": checks, "native": n, "go": g,
              "step_ms": {"native": round(n["step_s"] * 1e3, 3), "go": round(g["step_s"] * 1e3, 3)}}
    print(json.dumps(result, indent=1))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
