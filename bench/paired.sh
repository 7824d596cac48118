#!/usr/bin/env bash
# Paired benchmark of two builds: runs the benchmarks matching PATTERN from OLD and NEW (test
# binaries of the root package, built with `go test -c`), alternating them ROUNDS times, so that
# drift of the machine falls on both alike. Writes OUTDIR/old.txt and OUTDIR/new.txt for benchstat.
#   bash bench/paired.sh OLD.test NEW.test ROUNDS PATTERN OUTDIR [more -test. flags]
set -euo pipefail
old=$1 new=$2 rounds=$3 pattern=$4 out=$5
shift 5
mkdir -p "$out"
: > "$out/old.txt"
: > "$out/new.txt"
for ((i = 1; i <= rounds; i++)); do
	"$old" -test.run '^$' -test.bench "$pattern" -test.count 1 "$@" >> "$out/old.txt"
	"$new" -test.run '^$' -test.bench "$pattern" -test.count 1 "$@" >> "$out/new.txt"
done
