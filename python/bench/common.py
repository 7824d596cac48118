"""What the benchmark scripts share: flags, the environment set before the GPU library is
imported, the go allocator's set-up, step timing, hashing, and the one JSON line each prints.

Nothing here imports torch or cupy: the scripts set environment variables that must precede those
imports, then import them.
"""
import argparse
import hashlib
import json
import os
import statistics
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def import_gormm_rmm():
    """gormm_rmm as installed, else from this repository's python/ (with GORMM_RMM_LIBRARY)."""
    try:
        import gormm_rmm
    except ImportError:
        sys.path.insert(0, os.path.dirname(HERE))
        import gormm_rmm
    return gormm_rmm


def parser(description, workloads, allocators):
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload", required=True, choices=workloads)
    ap.add_argument("--allocator", required=True, choices=allocators)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=-1, help="steps left out of the median (default: steps/5, at most 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", default="stitching", choices=["stitching", "expandable", "plain"],
                    help="the Go pool's kind (--allocator go)")
    ap.add_argument("--go-statistics", action="store_true",
                    help="count the Go pool's allocations (peak allocated bytes), at some cost per call")
    return ap


def warmup_of(a):
    return a.warmup if a.warmup >= 0 else min(10, a.steps // 5)


class Steps:
    """Times each step (the caller synchronises the device around it) and samples memory after."""

    def __init__(self, sync, sample=None):
        self.sync, self.sample, self.times = sync, sample, []

    def run(self, fn):
        self.sync()
        t0 = time.perf_counter()
        r = fn()
        self.sync()
        self.times.append(time.perf_counter() - t0)
        if self.sample:
            self.sample()
        return r

    def median_ms(self, warmup):
        t = self.times[warmup:] or self.times
        return round(statistics.median(t) * 1e3, 4) if t else None


def hash_floats(values, fmt="f"):
    """sha256 of the values packed little-endian: "f" float32 (losses of float32 tensors are exact
    in it), "d" float64, "q" int64."""
    return hashlib.sha256(struct.pack("<%d%s" % (len(values), fmt), *values)).hexdigest()


def emit(record):
    print(json.dumps(record, sort_keys=True), flush=True)
