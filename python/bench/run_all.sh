#!/usr/bin/env bash
# Runs every workload of torch_workloads.py and cupy_workloads.py on every allocator, each run in
# a process of its own, appends their JSON lines to one file, and prints a summary (median step
# time, peak reserved, whether the result hash equals the first allocator's).
#
#   python/bench/run_all.sh [--short] [--steps N] [--seeds "0 1 2"] [--out FILE] [--only REGEX]
#
# --short runs 6 steps a workload (the form go test's GPU check uses); --only keeps the runs whose
# "suite:workload:allocator" matches REGEX (e.g. 'torch:gpt|cupy:fft'). Without
# GORMM_RMM_LIBRARY, the library is built from this repository when go is on the PATH, else the
# installed gormm_rmm package's copy is used. Each run is stopped after RUN_TIMEOUT seconds (480);
# the exit status is 1 when a run failed, a result differs from the first allocator's or the Go
# pool's invariants did not hold.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
steps=60
seeds=0
only=.
out=python-bench-$(date +%Y%m%d-%H%M%S).jsonl
while [[ $# -gt 0 ]]; do
	case $1 in
	--short) steps=6 ;;
	--steps) steps=$2; shift ;;
	--seeds) seeds=$2; shift ;;
	--out) out=$2; shift ;;
	--only) only=$2; shift ;;
	*) echo "run_all.sh: unknown flag $1" >&2; exit 2 ;;
	esac
	shift
done
py=${PYTHON:-python3}
if [[ -z ${GORMM_RMM_LIBRARY:-} ]] && command -v go >/dev/null; then
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	(cd "$root" && CGO_ENABLED=1 go build -buildmode=c-shared -o "$tmp/librmm_go.so" ./cmd/rmm-python)
	export GORMM_RMM_LIBRARY=$tmp/librmm_go.so
fi
: >>"$out"
failed=0

run() { # suite script workload allocator seed
	local tag="$1:$3:$4"
	[[ $tag =~ $only ]] || return 0
	echo "== $tag seed $5" >&2
	local err
	err=$(mktemp)
	local rc=0
	timeout -k 30 "${RUN_TIMEOUT:-480}" "$py" "$here/$2" --workload "$3" --allocator "$4" --steps "$steps" \
		--seed "$5" >>"$out" 2>"$err" || rc=$?
	if [[ $rc -ne 0 ]]; then
		failed=$((failed + 1))
		[[ $rc -eq 124 || $rc -eq 137 ]] && echo "run_all.sh: $tag timed out after ${RUN_TIMEOUT:-480} s" >>"$err"
		# A failed run leaves a line saying so, so that the summary shows it.
		"$py" -c 'import json, sys; print(json.dumps({"suite": sys.argv[1], "workload": sys.argv[2], "allocator": sys.argv[3], "seed": int(sys.argv[4]), "rc": int(sys.argv[6]), "error": open(sys.argv[5], errors="replace").read()[-2000:]}))' \
			"$1" "$3" "$4" "$5" "$err" "$rc" >>"$out" || echo "run_all.sh: could not record the failure of $tag" >&2
	fi
	cat "$err" >&2
	rm -f "$err"
}

# CuPy compiles its kernels on first use and keeps them on disk: one untimed run of each CuPy
# workload first, so that the first allocator's timed steps do not pay the compiles.
for w in fft etl; do
	if [[ cupy:$w:cupy-default =~ $only || cupy:$w:cupy-async =~ $only || cupy:$w:go =~ $only ]]; then
		echo "== cupy:$w priming the kernel cache" >&2
		timeout -k 30 "${RUN_TIMEOUT:-480}" "$py" "$here/cupy_workloads.py" --workload "$w" --allocator cupy-default \
			--steps "$steps" >/dev/null 2>&1 || echo "run_all.sh: priming cupy:$w failed" >&2
	fi
done

for seed in $seeds; do
	for w in seg gpt generate; do
		for al in torch-default torch-expandable go; do run torch torch_workloads.py "$w" "$al" "$seed"; done
	done
	for w in fft etl; do
		for al in cupy-default cupy-async go; do run cupy cupy_workloads.py "$w" "$al" "$seed"; done
	done
done

rc=0
"$py" "$here/summary.py" "$out" || rc=$?
echo "results: $out ($failed runs failed)" >&2
[[ $failed -eq 0 ]] || rc=1
exit $rc
