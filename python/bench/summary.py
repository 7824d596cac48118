"""Summarises the JSON lines of run_all.sh: per workload and seed, each allocator's median step
time and peak reserved, and whether its result hash equals the first allocator's.

    python3 python/bench/summary.py results.jsonl
"""
import json
import sys


def main(path):
    rows = []
    for line in open(path, errors="replace"):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and "suite" in r and "workload" in r:
            rows.append(r)
    bad = 0
    groups = {}
    for r in rows:
        groups.setdefault((r["suite"], r["workload"], r.get("seed", 0)), []).append(r)
    print("%-6s %-9s %-4s %-17s %12s %14s %14s  %s" % ("suite", "workload", "seed", "allocator", "step ms",
                                                      "peak reserved", "device peak", "hash"))
    for (suite, w, seed), rs in groups.items():
        ref = next((r["hash"] for r in rs if "hash" in r), None)
        for r in rs:
            if "error" in r:
                last = r["error"].strip().splitlines()
                print("%-6s %-9s %-4s %-17s  FAILED: %s" % (suite, w, seed, r["allocator"], last[-1] if last else ""))
                bad += 1
                continue
            mib = lambda v: "%.1f MiB" % (v / 2**20) if isinstance(v, int) else "-"
            print("%-6s %-9s %-4s %-17s %12s %14s %14s  %s" % (
                suite, w, seed, r["allocator"], r["median_step_ms"], mib(r.get("peak_reserved")),
                mib(r.get("device_used_peak")), "same" if r["hash"] == ref else "DIFFERS")
                + ("" if r.get("go_pool_invariants", "hold") == "hold" else "  INVARIANTS: %s" % r["go_pool_invariants"]))
            bad += r["hash"] != ref or r.get("go_pool_invariants", "hold") != "hold"
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
