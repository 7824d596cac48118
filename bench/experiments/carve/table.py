"""Prints the carving table of README.md: run from the repository root with the patch applied,
after `go build -o rmm-replay-carve ./cmd/rmm-replay`:

    python3 bench/experiments/carve/table.py ./rmm-replay-carve testdata/traces/*.csv.gz
"""
import os, re, subprocess, sys

CFGS = [("current", {}), ("8 MiB pages", {"XPAGE": "8388608", "XCARVE": "1"}),
        ("16 MiB", {"XPAGE": "16777216", "XCARVE": "1"}), ("32 MiB", {"XPAGE": "33554432", "XCARVE": "1"})]
STATS = re.compile(r"creates (\d+) maps (\d+) remaps (\d+) unmaps (\d+) carves (\d+)")


def run(binary, env, trace, passes):
    e = dict(os.environ, XREP="1", **env)
    out = subprocess.run([binary, "-simulate", "140GiB", "-passes", str(passes), trace], env=e,
                         capture_output=True, text=True, check=True).stdout
    ratio = re.search(r"peak upstream .*\), ([0-9.]+) x", out).group(1)
    keys = ["creates", "maps", "remaps", "unmaps", "carves"]
    stats = [dict(zip(keys, map(int, STATS.search(l).groups()))) for l in out.splitlines() if l.startswith("pass ")]
    return ratio, stats


def ms(d):  # H200 costs per call (µs): create 15.8, map + access 55, unmap 29.7
    return (d["creates"] * 15.8 + d["maps"] * 55 + d["unmaps"] * 29.7) / 1000


binary, traces = sys.argv[1], sys.argv[2:]
print("| trace | " + " | ".join(c for c, _ in CFGS) + " |")
print("|---|" + "---|" * len(CFGS))
for t in sorted(traces):
    cells = []
    for _, env in CFGS:
        r1, _ = run(binary, env, t, 1)
        r3, st = run(binary, env, t, 3)
        p1, d3 = st[0], {k: st[2][k] - st[1][k] for k in st[2]}
        cells.append(f"{r1} / {r3}; p1 {p1['creates']}c {p1['maps']}m {p1['unmaps']}u {p1['carves']}s ({ms(p1):.0f} ms); "
                     f"p3 {d3['maps']}m {d3['unmaps']}u {d3['carves']}s ({ms(d3):.0f} ms)")
    print(f"| {os.path.basename(t)[:-7]} | " + " | ".join(cells) + " |")
