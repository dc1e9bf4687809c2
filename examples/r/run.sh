#!/usr/bin/env bash
# R with ff on remote memory (Remote Regions paper §8.6), against tmpfs in the same run.
#
#   examples/r/run.sh MOUNT_OF_HOST_1 MOUNT_OF_HOST_2 [--small]
#
# 1. writes the data set (an ffdf, one ff file per column) into a region
#    directory held in host 2's memory (user.regions.hostalloc), through
#    host 2's mount, and the same data (same seed) into a tmpfs directory;
# 2. R on host 1 opens the data set through host 1's mount, which has never
#    read it (its page cache is cold: every byte comes from host 2's daemon),
#    and runs R-Agg and R-LR, each run in a fresh R process, alternating with
#    the same runs on tmpfs; a second round repeats them with host 1's page
#    cache warm (R-Agg reads columns 1-10, R-LR columns 11-20, so each
#    workload's first run on regions is cold);
# 3. prints both times and their ratio, and fails unless the results equal
#    the tmpfs ones (floating-point tolerance).
#
# Size: 50 columns x 5,000,000 rows (1.9 GiB) by default; --small (or
# REGIONS_DEMO_SMALL=1) 50 x 200,000; REGIONS_R_ROWS / REGIONS_R_COLS override.
# Needs Rscript and the ff package (apt-get install r-cran-ff) and getfattr/
# setfattr (apt-get install attr); host 2's daemon must offer the data size.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

A=${1:-}
B=${2:-}
small=${REGIONS_DEMO_SMALL:-0}
[ "${3:-}" = --small ] && small=1
if [ -z "$A" ] || [ -z "$B" ]; then
  echo "usage: $0 MOUNT_OF_HOST_1 MOUNT_OF_HOST_2 [--small]" >&2
  exit 2
fi
if [ "$small" = 1 ]; then rows=200000; else rows=5000000; fi
rows=${REGIONS_R_ROWS:-$rows}
cols=${REGIONS_R_COLS:-50}
seed=${REGIONS_R_SEED:-2018}
rounds=2

if ! Rscript -e 'suppressPackageStartupMessages(library(ff))' >/dev/null 2>&1; then
  echo "r demo: Rscript with the ff package is missing: apt-get install -y r-cran-ff" >&2
  exit 1
fi

host_a=$(getfattr --absolute-names --only-values -n user.regions.hostid "$A")
host_b=$(getfattr --absolute-names --only-values -n user.regions.hostid "$B")
[ "$host_a" != "$host_b" ] || { echo "r demo: both mounts are host $host_a" >&2; exit 1; }

name=ffdemo-$$
tmpfs=$(mktemp -d /dev/shm/regions-ffdemo.XXXXXX)
if [ "$(stat -f -c %T "$tmpfs")" != tmpfs ]; then
  echo "r demo: /dev/shm is not a tmpfs here; cannot run the baseline" >&2
  exit 1
fi
cleanup() {
  rm -rf "$tmpfs"
  rm -rf "${B:?}/$name" 2>/dev/null || true
}
trap cleanup EXIT

echo "== data set: $cols columns x $rows rows of doubles ($((cols * rows * 8 / 1048576)) MiB), seed $seed"
mkdir "$B/$name"
setfattr -n user.regions.hostalloc -v "$host_b" "$B/$name"
echo "-- regions: $B/$name (host $host_b's memory), written by R on host $host_b"
start=$(date +%s%N)
Rscript "$here/ffdemo.R" generate "$B/$name" "$rows" "$cols" "$seed"
echo "   took $((($(date +%s%N) - start) / 1000000)) ms"
where=$(getfattr --absolute-names --only-values -n user.regions.hosts "$A/$name/c11.ff")
if [ "$where" != "$host_b" ]; then
  echo "r demo: c11.ff is held on host(s) $where, expected host $host_b" >&2
  exit 1
fi
echo "-- tmpfs: $tmpfs"
Rscript "$here/ffdemo.R" generate "$tmpfs" "$rows" "$cols" "$seed"

results=$(mktemp -d)
trap 'cleanup; rm -rf "$results"' EXIT
echo "== R on host $host_a: each run a fresh R process; regions copy read through $A (held on host $where)"
for round in $(seq 1 "$rounds"); do
  if [ "$round" = 1 ]; then
    echo "-- round 1: host $host_a's page cache has never held the regions copy (cold)"
  else
    echo "-- round $round: warm"
  fi
  for w in R-Agg R-LR; do
    # Alternate which copy goes first.
    if [ $((round % 2)) = 1 ]; then order="tmpfs regions"; else order="regions tmpfs"; fi
    for fs in $order; do
      if [ "$fs" = tmpfs ]; then dir=$tmpfs; else dir=$A/$name; fi
      Rscript "$here/ffdemo.R" run "$w" "$dir" "$rows" "$cols" "$results/$round-$w-$fs.rds"
    done
  done
done
echo "== results"
Rscript "$here/ffdemo.R" compare "$results" "$rounds"
