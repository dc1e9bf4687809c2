#!/usr/bin/env bash
# Paper 003 Fig. 1 with shell tools, on two hosts of one cluster:
# host 1 creates a region, writes it; host 2 reads it; attributes with
# setfattr/getfattr; the .regions/ metadata; removal seen from both hosts.
#
#   examples/shell/walkthrough.sh MOUNT_OF_HOST_1 MOUNT_OF_HOST_2
#   (or REGIONS_DEMO_MOUNT_A / REGIONS_DEMO_MOUNT_B)
#
# Runs against any running cluster: the two arguments are regionfs mounts of
# two different host ids (examples/run-demo.sh shell starts one). Every step
# checks its output and the script exits non-zero at the first mismatch.
# Needs getfattr/setfattr (apt-get install attr); .regions/ needs root.
set -euo pipefail

A=${1:-${REGIONS_DEMO_MOUNT_A:-}}
B=${2:-${REGIONS_DEMO_MOUNT_B:-}}
if [ -z "$A" ] || [ -z "$B" ]; then
  echo "usage: $0 MOUNT_OF_HOST_1 MOUNT_OF_HOST_2" >&2
  exit 2
fi
for t in getfattr setfattr sha256sum; do
  command -v "$t" >/dev/null || { echo "walkthrough: $t is missing (apt-get install attr coreutils)" >&2; exit 1; }
done

step() { printf '\n== %s\n' "$*"; }
# show CMD...: prints the command as typed, then runs it
# (paths inside the mounts print as $A/... and $B/...)
show() {
  local line="" arg
  for arg in "$@"; do
    case $arg in *" "*) arg="\"$arg\"" ;; esac
    line+="${line:+ }$arg"
  done
  line=${line//"$A"/'$A'}
  line=${line//"$B"/'$B'}
  printf '$ %s\n' "$line"
  "$@"
}
# expect WHAT ACTUAL EXPECTED
expect() {
  if [ "$2" != "$3" ]; then
    printf 'walkthrough: FAILED: %s: got %q, expected %q\n' "$1" "$2" "$3" >&2
    exit 1
  fi
  printf '   ok: %s\n' "$1"
}
xattr() { getfattr --absolute-names --only-values -n "$1" "$2"; }

host_a=$(xattr user.regions.hostid "$A")
host_b=$(xattr user.regions.hostid "$B")
step "two mounts of one cluster: A=$A is host $host_a, B=$B is host $host_b"
show getfattr --absolute-names -n user.regions.hostid "$A" "$B"
[ "$host_a" != "$host_b" ] || { echo "walkthrough: both mounts are host $host_a; give mounts of two hosts" >&2; exit 1; }

d=fig1-$$
trap 'rm -rf "${A:?}/$d" 2>/dev/null || true' EXIT

step "host $host_a: a directory whose regions live on host $host_a, and a region 'oz' in it"
show mkdir "$A/$d"
show setfattr -n user.regions.hostalloc -v "$host_a" "$A/$d"
show truncate -s 4096 "$A/$d/oz" # allocate a buffer in the region
echo '$ echo "Hello from host '"$host_a"'" | dd of=$A/'"$d"'/oz conv=notrunc'
echo "Hello from host $host_a" | dd of="$A/$d/oz" conv=notrunc status=none
show ls -l "$A/$d"
expect "oz is 4096 bytes" "$(stat -c %s "$A/$d/oz")" 4096
expect "oz lives on host $host_a" "$(xattr user.regions.hosts "$A/$d/oz")" "$host_a"

step "host $host_b reads host $host_a's string (an RDMA read, with head)"
show head -n 1 "$B/$d/oz"
expect "host $host_b reads the string" "$(head -n 1 "$B/$d/oz")" "Hello from host $host_a"
expect "host $host_b sees the region on host $host_a" "$(xattr user.regions.hosts "$B/$d/oz")" "$host_a"

step "host $host_a writes 16 MiB with dd; host $host_b checks it with sha256sum"
src=$(mktemp)
trap 'rm -f "$src"; rm -rf "${A:?}/$d" 2>/dev/null || true' EXIT
head -c 16M /dev/urandom >"$src"
show dd if="$src" of="$A/$d/blob" bs=1M status=none
show sha256sum "$B/$d/blob"
want=$(sha256sum <"$src" | cut -d' ' -f1)
expect "host $host_b reads what host $host_a wrote" "$(sha256sum <"$B/$d/blob" | cut -d' ' -f1)" "$want"

step "host $host_b writes with seq; host $host_a reads it (close-to-open consistency)"
echo "\$ seq 1 100000 >> \$B/$d/numbers"
seq 1 100000 >>"$B/$d/numbers"
show wc -l "$A/$d/numbers"
expect "host $host_a counts host $host_b's lines" "$(wc -l <"$A/$d/numbers")" 100000
expect "and sums them" "$(awk '{s += $1} END {printf "%.0f", s}' "$A/$d/numbers")" 5000050000

step "attributes: a directory on host $host_b, and one spread over both hosts"
show mkdir "$A/$d/far" "$A/$d/spread"
show setfattr -n user.regions.hostalloc -v "$host_b" "$A/$d/far"
show setfattr -n user.regions.multihosted -v 1 "$A/$d/spread"
show setfattr -n user.regions.hostalloc -v "$host_a,$host_b" "$A/$d/spread"
show getfattr --absolute-names -n user.regions.multihosted "$A/$d/spread"
head -c 1M "$src" >"$A/$d/far/region"
head -c 8M "$src" >"$A/$d/spread/region"
show getfattr --absolute-names -n user.regions.hosts "$A/$d/far/region" "$A/$d/spread/region"
expect "written from host $host_a, held on host $host_b" "$(xattr user.regions.hosts "$A/$d/far/region")" "$host_b"
spread=$(xattr user.regions.hosts "$A/$d/spread/region" | tr ',' '\n' | sort -n | paste -sd,)
both=$(printf '%s\n' "$host_a" "$host_b" | sort -n | paste -sd,)
expect "a multi-hosted region spans both hosts" "$spread" "$both"
expect "it reads back whole on host $host_b" "$(cmp -n 8388608 "$B/$d/spread/region" "$src" && echo same)" same
show setfattr -n user.comment -v "paper Fig. 1" "$A/$d/oz"
show getfattr --absolute-names -n user.comment "$B/$d/oz"
expect "host $host_b reads host $host_a's xattr" "$(xattr user.comment "$B/$d/oz")" "paper Fig. 1"

step "cluster metadata under .regions/ (root only)"
show ls "$A/.regions"
show cat "$A/.regions/hosts"
expect "both hosts are live" \
  "$(awk -v a="$host_a" -v b="$host_b" 'NR > 1 && ($1 == a || $1 == b) && $3 == "yes"' "$A/.regions/hosts" | wc -l)" 2
show cat "$A/.regions/files/$d/oz"
show cat "$B/.regions/memusage"

step "host $host_b removes everything; host $host_a sees it gone"
show rm -r "$B/$d"
# Host 1's kernel may keep its entry for $d up to the mount's 1 s entry TTL
# (like NFS attribute caching); wait for it, at most 5 s.
for ((i = 0; i < 50; i++)); do
  [ -e "$A/$d" ] || break
  sleep 0.1
done
if [ -e "$A/$d" ]; then
  echo "walkthrough: FAILED: $A/$d still exists 5 s after rm on host $host_b" >&2
  exit 1
fi
show ls "$A"
expect "gone on host $host_a" "$(ls -A "$A" | grep -cx "$d" || true)" 0

printf '\nwalkthrough: all steps passed\n'
