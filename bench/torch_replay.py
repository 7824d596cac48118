"""Replay RMM CSV traces through PyTorch's CUDA caching allocator and report its footprint.

    python3 bench/torch_replay.py [--passes N] [--conf CONF] TRACE.csv[.gz] ...

Each trace is replayed in its own process, so that PYTORCH_CUDA_ALLOC_CONF (--conf, e.g.
"expandable_segments:True"; "" for the default) applies from the first allocation. Events run in
the file's order on one thread: an allocation is what torch.cuda.caching_allocator_alloc(size, 0,
stream) calls (the allocator's raw_alloc), a free is caching_allocator_delete's raw_delete, each trace stream gets a torch.cuda.Stream of its
own ("0" is the legacy default stream); logged failures are skipped, and what a pass leaves
allocated is freed at its end, as rmm-replay does. After pass 1 and after the last pass it prints
the allocator's peak reserved bytes (reserved_bytes.all.peak) over the trace's peak live bytes
(the highest sum of requested sizes). Output: one JSON object per trace.
"""
import argparse, csv, gzip, io, json, os, subprocess, sys, time


def read(path):
    raw = open(path, "rb").read()
    if path.endswith(".gz"):
        raw = gzip.decompress(raw)
    rows = []
    for r in csv.DictReader(io.StringIO(raw.decode())):
        rows.append((r["Action"], r["Pointer"], int(r["Size"]), r["Stream"].strip()))
    return rows


def peak_live(rows):
    live, cur, peak = {}, 0, 0
    for act, ptr, size, _ in rows:
        if act == "allocate":
            live[ptr] = size
            cur += size
            peak = max(peak, cur)
        elif act == "free" and ptr in live:
            cur -= live.pop(ptr)
    return peak


def child(path, passes):
    import torch
    rows = read(path)
    torch.cuda.init()
    streams = {"0": 0}
    keep = []
    for _, _, _, s in rows:
        if s not in streams:
            st = torch.cuda.Stream()
            keep.append(st)
            streams[s] = st.cuda_stream
    ops = [(act == "allocate", ptr, size, streams[s]) for act, ptr, size, s in rows if act in ("allocate", "free")]
    # The two calls that caching_allocator_alloc and caching_allocator_delete make, without their
    # per-call argument checks and device switch (one device, streams given as raw handles).
    alloc, delete = torch._C._cuda_cudaCachingAllocator_raw_alloc, torch._C._cuda_cudaCachingAllocator_raw_delete
    out = dict(trace=os.path.basename(path), conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
               torch=torch.__version__, events=len(ops), peak_live=peak_live(rows), passes=[])
    for p in range(passes):
        live, t0 = {}, time.perf_counter()
        for is_alloc, ptr, size, s in ops:
            if is_alloc:
                if size > 0:
                    live[ptr] = alloc(size, s)
            else:
                q = live.pop(ptr, None)
                if q is not None:
                    delete(q)
        for q in live.values():
            delete(q)
        wall = time.perf_counter() - t0
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats()
        res = int(st["reserved_bytes.all.peak"])
        out["passes"].append(dict(pass_=p + 1, peak_reserved=res, ratio=round(res / max(out["peak_live"], 1), 4),
                                  ns_per_event=round(wall * 1e9 / max(len(ops), 1)), num_ooms=int(st.get("num_ooms", 0))))
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--conf", default="expandable_segments:True", help='PYTORCH_CUDA_ALLOC_CONF for the replays ("" for the default)')
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("traces", nargs="+")
    a = ap.parse_args()
    if a.child:
        child(a.traces[0], a.passes)
        return
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=a.conf)
    if not a.conf:
        env.pop("PYTORCH_CUDA_ALLOC_CONF")
    rc = 0
    for t in a.traces:
        r = subprocess.run([sys.executable, __file__, "--child", "--passes", str(a.passes), t], env=env,
                           capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        if r.returncode:
            rc = 1
            sys.stderr.write("%s: exit %d\n%s" % (t, r.returncode, r.stderr[-2000:]))
    sys.exit(rc)


if __name__ == "__main__":
    main()
