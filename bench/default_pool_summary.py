#!/usr/bin/env python3
"""Tables of bench/default-pool.sh's output: per trace, each pool's first pass and later passes
(ns per event), its footprint after one pass and after three (peak reserved over peak live), and
the default pool's mappings in the first pass; then the serving workload by windows.

    python3 bench/default_pool_summary.py OUTDIR
"""
import glob
import json
import os
import statistics
import sys


def load(path):
    with open(path) as f:
        d = json.load(f)
    return d if isinstance(d, list) else [d]


def fp(r, w=None):
    live = max(r["peak_live_bytes"], 1)
    peak = r["windows"][w]["peak_reserved_bytes"] if w is not None else r["peak_reserved_bytes"]
    return peak / live


def later(r):
    return statistics.median(w["ns_per_event"] for w in r["windows"][1:])


def main(out):
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        name = os.path.basename(path)[: -len(".json")]
        if name.endswith("-old") or name == "serving":
            continue
        by = {r["name"]: r for r in load(path)}
        old = None
        if os.path.exists(os.path.join(out, name + "-old.json")):
            o = load(os.path.join(out, name + "-old.json"))[0]
            old = o["wall_ns"][0] / o["events"]
        rows.append((name, by, old))
    print("| trace | events | default: pass 1 ns/event (before) | passes 2-3 | footprint p1 / p3 | maps p1 | expandable: p1, p2-3 ns/event | footprint p1 / p3 | plain: footprint p1 / p3 | async: p1, p2-3 ns/event | footprint p1 / p3 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, by, old in rows:
        s, e, p, a = (by.get(k) for k in ("stitching", "expandable", "plain", "async"))
        cells = [name, str(s["events"]) if s else ""]
        if s:
            before = f" ({old:,.0f})" if old else ""
            cells += [f"{s['windows'][0]['ns_per_event']:,.0f}{before}", f"{later(s):,.0f}",
                      f"{fp(s, 0):.3f} / {fp(s):.3f}", str((s.get("vmm_per_pass") or [{}])[0].get("maps", ""))]
        else:
            cells += [""] * 4
        for r in (e,):
            cells += [f"{r['windows'][0]['ns_per_event']:,.0f}, {later(r):,.0f}", f"{fp(r, 0):.3f} / {fp(r):.3f}"] if r else ["", ""]
        cells += [f"{fp(p, 0):.3f} / {fp(p):.3f}"] if p else [""]
        cells += [f"{a['windows'][0]['ns_per_event']:,.0f}, {later(a):,.0f}", f"{fp(a, 0):.3f} / {fp(a):.3f}"] if a else ["", ""]
        print("| " + " | ".join(cells) + " |")
    sp = os.path.join(out, "serving.json")
    if os.path.exists(sp):
        for r in load(sp):
            print(f"\n{r['name']}: {r['events']} events, {r['failures']} failed, peak reserved / peak live {fp(r):.3f}")
            print("| events | ns/event | peak live | peak reserved | reserved/live | creates | maps | unmaps | releases | stitched | evicted | kept | address space |")
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for w in r["windows"]:
                v = w.get("vmm") or {}
                gib = 1 << 30
                print(f"| {w['first_event'] + w['events']:,} | {w['ns_per_event']:,.0f} | {w['peak_live_bytes'] / gib:.2f} GiB | {w['peak_reserved_bytes'] / gib:.2f} GiB | "
                      f"{w.get('reserved_over_live', 0):.3f} | {v.get('creates', '')} | {v.get('maps', '')} | {v.get('unmaps', '')} | {v.get('releases', '')} | "
                      f"{v.get('stitched_ranges', '')} | {v.get('stitched_evicted', '')} | {v.get('stitched_kept', '')} | "
                      f"{v.get('address_reserved_bytes', 0) / gib:.1f} GiB |")


if __name__ == "__main__":
    main(sys.argv[1])
