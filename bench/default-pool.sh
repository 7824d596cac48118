#!/usr/bin/env bash
# The default pool's figures beside the others, on the machine it runs on: every bundled trace
# replayed at three passes on the stitching pool (the default), the expandable pool without
# stitching, librmm's pool and cudaMallocAsync, one process per trace, with the windows of
# rmm-replay set to the trace's length so that each pass is a window of its own; then the
# generated serving workload (cmd/rmm-workload) at two million events on the default pool and on
# cudaMallocAsync, in windows of 100,000 events. With OLD, an earlier rmm-replay binary also
# replays each trace on its stitching pool (OLD_FLAGS, default "-mr expandable -stitch", the
# flags of the builds before -mr stitching), for a before/after in the same run.
#
#   bash bench/default-pool.sh RMM_REPLAY RMM_WORKLOAD OUTDIR [OLD_RMM_REPLAY]
#   python3 bench/default_pool_summary.py OUTDIR
#
# MRS and SERVING_MRS change the resources (e.g. without async where there is no GPU), and
# SERVING_FLAGS adds flags to the serving replay (e.g. -simulate 256GiB). Build the binaries
# with go build -o (cgo on, for the GPU). Writes OUTDIR/<trace>.json (a list,
# one object per resource), OUTDIR/<trace>-old.json and OUTDIR/serving.json.
set -u
replay=$1 workload=$2 out=$3 old=${4:-}
old_flags=${OLD_FLAGS:--mr expandable -stitch}
mkdir -p "$out"
cd "$(dirname "$0")/.."
for t in testdata/traces/*.csv.gz; do
	name=$(basename "$t" .csv.gz)
	n=$(zcat "$t" | tail -n +2 | wc -l)
	"$replay" -json -passes 3 -window "$n" -mr "${MRS:-stitching,expandable,plain,async}" "$t" > "$out/$name.json" 2> "$out/$name.err"
	if [ -n "$old" ]; then
		# shellcheck disable=SC2086
		"$old" -json -passes 3 $old_flags "$t" > "$out/$name-old.json" 2>> "$out/$name.err"
	fi
done
"$workload" -seed 1 -events 2000000 -o "$out/serving.csv.gz"
"$replay" -json -window 100000 -mr "${SERVING_MRS:-pool,async}" ${SERVING_FLAGS:-} "$out/serving.csv.gz" > "$out/serving.json" 2> "$out/serving.err"
rm -f "$out/serving.csv.gz"
