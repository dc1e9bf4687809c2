#!/usr/bin/env bash
# regionfs benchmark: reads and mmap faults through a real REGIONFS mount,
# each next to tmpfs measured in the same run.
#
#   bash benches/regionfs.sh [--size 2G] [--quick] [--cache passthrough|writeback]
#                            [--keep-logs]
#
# Starts, in a temporary directory, one regions-manager, two regions-daemon
# (host 1 and host 2) and two `regionfs mount`s (host 1 at MNT1, host 2 at
# MNT2), plus a tmpfs as the baseline, then measures:
#
#   1. sequential 1 MiB reads (fio, psync, buffered) of a --size file held by
#      host 2's daemon, read through MNT1: cold (after drop_caches) and warm;
#      next to the ceiling of any cold remote read on this machine, a bare
#      loopback TCP stream of memfd memory (benches/tcp_stream.c);
#   2. random 16 KiB reads of the same file, cold and warm (time-based);
#   3. a wholly local region (hostalloc=1) read through MNT1, served by FUSE
#      passthrough: sequential 1 MiB and random 16 KiB;
#   4. mmap first-touch latency of 4 KiB pages (benches/mmap_fault.c,
#      compiled here with cc): reads of the remote file and writes to another
#      remote file, each on a cold, fresh MAP_SHARED mapping, in page order
#      (with readahead) and in random order (MADV_RANDOM, one fault per page).
#
# It checks that what is read back is what was written (cmp of cold samples,
# whole-file cmp through the other host, mmap checksums), and prints a table:
# measurement | regions | tmpfs | ratio | target | met?
#
# Needs root (FUSE, tmpfs, drop_caches), the release binaries
# (cargo build --release --bins), fio, setfattr/getfattr (installed with
# apt-get when missing) and cc. Everything started is stopped by PID and
# every mount is unmounted on exit, Ctrl-C included.
#
# Exit status: 0 when the run completed and every check passed (targets
# may still be unmet: see the table), 1 when a check or a step failed,
# 2 for a usage or environment problem.

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${REGIONS_BIN_DIR:-$ROOT/target/release}

SIZE_ARG=2G
SIZE_SET=0
QUICK=0
CACHE1=passthrough
KEEP_LOGS=0

usage() {
    sed -n '2,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit "${1:-2}"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --size) [ $# -ge 2 ] || usage; SIZE_ARG=$2; SIZE_SET=1; shift 2 ;;
        --size=*) SIZE_ARG=${1#--size=}; SIZE_SET=1; shift ;;
        --quick) QUICK=1; shift ;;
        --cache) [ $# -ge 2 ] || usage; CACHE1=$2; shift 2 ;;
        --cache=*) CACHE1=${1#--cache=}; shift ;;
        --keep-logs) KEEP_LOGS=1; shift ;;
        -h|--help) usage 0 ;;
        *) echo "regionfs.sh: unknown argument: $1" >&2; usage ;;
    esac
done

say() { printf '%s\n' "== $*" >&2; }
warn() { printf '%s\n' "!! $*" >&2; }
fail() { printf '%s\n' "FAILED: $*" >&2; exit 1; }

# ---------------------------------------------------------------- sizes

# "2G", "256M", "1048576" -> bytes.
parse_size() {
    local t=${1^^} n s
    n=${t%%[!0-9]*}
    s=${t#"$n"}
    [ -n "$n" ] || { echo "regionfs.sh: bad size: $1" >&2; exit 2; }
    case "$s" in
        ""|B) echo "$n" ;;
        K|KB|KIB) echo $((n << 10)) ;;
        M|MB|MIB) echo $((n << 20)) ;;
        G|GB|GIB) echo $((n << 30)) ;;
        *) echo "regionfs.sh: bad size suffix in $1 (use K, M or G)" >&2; exit 2 ;;
    esac
}

MiB=$((1 << 20))
if [ "$QUICK" = 1 ]; then
    # 256 MiB unless --size says otherwise.
    if [ "$SIZE_SET" = 1 ]; then SIZE=$(parse_size "$SIZE_ARG"); else SIZE=$((256 * MiB)); fi
    RAND_SECS=2
    WARM_REPS=1
    MMAP_SIZE=$((32 * MiB))
    RAND_PAGES=1024
    CMP_SAMPLES=4
else
    SIZE=$(parse_size "$SIZE_ARG")
    RAND_SECS=5
    WARM_REPS=3
    MMAP_SIZE=$((256 * MiB))
    RAND_PAGES=4096
    CMP_SAMPLES=8
fi
# Whole MiB (regions are whole 128 KiB chunks; passthrough wants the file
# to fill its segment exactly).
SIZE=$(( (SIZE + MiB - 1) / MiB * MiB ))
[ "$SIZE" -ge $((16 * MiB)) ] || { echo "regionfs.sh: --size must be at least 16M" >&2; exit 2; }
[ "$MMAP_SIZE" -le "$SIZE" ] || MMAP_SIZE=$SIZE
SIZE_MIB=$((SIZE / MiB))
MMAP_MIB=$((MMAP_SIZE / MiB))
case "$CACHE1" in passthrough|writeback) ;; *) echo "regionfs.sh: --cache is passthrough or writeback" >&2; exit 2 ;; esac

# ---------------------------------------------------------------- environment

missing=()
for b in regions-manager regions-daemon regionfs; do
    [ -x "$BIN/$b" ] || missing+=("$b")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "regionfs.sh: missing release binaries in $BIN: ${missing[*]}" >&2
    echo "build them first:  cargo build --release --bins" >&2
    exit 2
fi
[ "$(id -u)" = 0 ] || { echo "regionfs.sh: run as root (FUSE mounts, tmpfs, drop_caches)" >&2; exit 2; }
[ -e /dev/fuse ] || { echo "regionfs.sh: /dev/fuse is missing" >&2; exit 2; }
command -v cc >/dev/null || { echo "regionfs.sh: cc (gcc) is needed to build benches/mmap_fault.c" >&2; exit 2; }

need_pkgs=()
command -v fio >/dev/null || need_pkgs+=(fio)
{ command -v setfattr >/dev/null && command -v getfattr >/dev/null; } || need_pkgs+=(attr)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    say "installing ${need_pkgs[*]} (apt-get)"
    if ! { apt-get install -y -qq "${need_pkgs[@]}" >/dev/null 2>&1 ||
           { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${need_pkgs[@]}" >/dev/null 2>&1; }; }; then
        echo "regionfs.sh: cannot install ${need_pkgs[*]}; install them (apt-get install -y ${need_pkgs[*]})" >&2
        exit 2
    fi
fi

# Memory: the remote file lives in host 2's pool, the local one in host
# 1's, their copies in tmpfs, and host 1's page cache holds the remote file
# once warm.
need_kib=$(( (SIZE * 5 + MMAP_SIZE * 4) / 1024 ))
avail_kib=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
if [ "$avail_kib" -lt "$need_kib" ]; then
    echo "regionfs.sh: needs about $((need_kib / 1024)) MiB of free memory for --size $SIZE_MIB M, $((avail_kib / 1024)) MiB available; use a smaller --size" >&2
    exit 2
fi

# ---------------------------------------------------------------- cluster

WORK=$(mktemp -d /tmp/regionfs-bench.XXXXXX)
MNT1=$WORK/mnt1
MNT2=$WORK/mnt2
TMPFS=$WORK/tmpfs
LOGS=$WORK/logs
mkdir -p "$MNT1" "$MNT2" "$TMPFS" "$LOGS" "$WORK/manager"
PIDS=()          # started processes, in start order
MOUNT_PIDS=()    # the regionfs mount processes among them
CLEANED=0

is_mounted() { mountpoint -q "$1" 2>/dev/null; }

# Waits up to $2 seconds for pid $1 to exit.
wait_gone() {
    local pid=$1 n=$(( $2 * 10 ))
    while [ $n -gt 0 ] && kill -0 "$pid" 2>/dev/null; do
        sleep 0.1
        n=$((n - 1))
    done
    ! kill -0 "$pid" 2>/dev/null
}

cleanup() {
    local rc=$?
    [ "$CLEANED" = 1 ] && return
    CLEANED=1
    trap '' INT TERM
    set +e
    # Mounts first (SIGTERM unmounts cleanly), then daemons and manager.
    local pid
    for pid in "${MOUNT_PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null
    done
    for pid in "${MOUNT_PIDS[@]}"; do
        wait_gone "$pid" 10 || { warn "mount process $pid did not stop; killing it"; kill -KILL "$pid" 2>/dev/null; }
    done
    local m
    for m in "$MNT1" "$MNT2" "$TMPFS"; do
        if is_mounted "$m"; then
            umount -l "$m" 2>/dev/null || warn "cannot unmount $m"
        fi
    done
    local i
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        pid=${PIDS[$i]}
        kill -0 "$pid" 2>/dev/null || continue
        kill -TERM "$pid" 2>/dev/null
        wait_gone "$pid" 10 || kill -KILL "$pid" 2>/dev/null
    done
    if is_mounted "$MNT1" || is_mounted "$MNT2" || is_mounted "$TMPFS"; then
        warn "something is still mounted under $WORK; leaving it in place"
    elif [ "$rc" = 1 ] || [ "$KEEP_LOGS" = 1 ]; then
        rm -rf "$WORK/manager" "$MNT1" "$MNT2" "$TMPFS" "$WORK/bin"
        warn "logs kept in $LOGS"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT
trap 'warn "interrupted"; exit 130' INT
trap 'warn "terminated"; exit 143' TERM

# Starts a node process in the background: start_node NAME ARGS...
start_node() {
    local name=$1
    shift
    "$@" >"$LOGS/$name.log" 2>&1 &
    PIDS+=("$!")
    LAST_PID=$!
}

# Waits for ready file $1 written by pid $2 (log $3).
wait_ready() {
    local file=$1 pid=$2 log=$3 n=300
    while [ $n -gt 0 ]; do
        [ -s "$file" ] && return 0
        if ! kill -0 "$pid" 2>/dev/null; then
            warn "process $pid exited before it was ready; its log ($log):"
            tail -n 20 "$log" >&2
            exit 1
        fi
        sleep 0.1
        n=$((n - 1))
    done
    warn "no ready file $file after 30 s; log ($log):"
    tail -n 20 "$log" >&2
    exit 1
}

say "load before: $(cut -d' ' -f1-3 /proc/loadavg) (1/5/15 min, $(nproc) cpus)"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)

mkdir -p "$WORK/bin"
cc -O2 -Wall -I "$ROOT/regionfs/include" -o "$WORK/bin/mmap_fault" "$ROOT/benches/mmap_fault.c" ||
    fail "cannot compile benches/mmap_fault.c"
MF=$WORK/bin/mmap_fault
cc -O2 -Wall -o "$WORK/bin/tcp_stream" "$ROOT/benches/tcp_stream.c" ||
    fail "cannot compile benches/tcp_stream.c"

head -c 48 /dev/urandom | base64 | tr -d '\n' >"$WORK/secret"
chmod 600 "$WORK/secret"

# Pools: host 2 holds the remote file and the mmap write file; host 1 the
# local region.
DAEMON_MIB=$(( SIZE_MIB * 3 / 2 + MMAP_MIB * 2 + 64 ))

say "starting the manager, daemons (${DAEMON_MIB}M each) and mounts in $WORK"
start_node manager "$BIN/regions-manager" --listen 127.0.0.1:0 --data-dir "$WORK/manager" \
    --secret-file "$WORK/secret" --ready-file "$WORK/manager.ready"
wait_ready "$WORK/manager.ready" "$LAST_PID" "$LOGS/manager.log"
MANAGER=$(tr -d '[:space:]' <"$WORK/manager.ready")
MANAGER_URL=http://$MANAGER

for h in 1 2; do
    start_node "daemon$h" "$BIN/regions-daemon" --manager "$MANAGER_URL" --host-id "$h" \
        --listen 127.0.0.1:0 --memory "${DAEMON_MIB}M" --socket "$WORK/h$h.sock" \
        --secret-file "$WORK/secret" --ready-file "$WORK/daemon$h.ready"
    wait_ready "$WORK/daemon$h.ready" "$LAST_PID" "$LOGS/daemon$h.log"
done

start_node mount1 "$BIN/regionfs" mount --manager "$MANAGER_URL" --host-id 1 \
    --secret-file "$WORK/secret" --agent-socket "$WORK/h1.sock" --cache "$CACHE1" \
    --ready-file "$WORK/mount1.ready" "$MNT1"
MOUNT_PIDS+=("$LAST_PID")
wait_ready "$WORK/mount1.ready" "$LAST_PID" "$LOGS/mount1.log"
start_node mount2 "$BIN/regionfs" mount --manager "$MANAGER_URL" --host-id 2 \
    --secret-file "$WORK/secret" --agent-socket "$WORK/h2.sock" \
    --ready-file "$WORK/mount2.ready" "$MNT2"
MOUNT_PIDS+=("$LAST_PID")
wait_ready "$WORK/mount2.ready" "$LAST_PID" "$LOGS/mount2.log"
is_mounted "$MNT1" && is_mounted "$MNT2" || fail "the mounts are not in /proc/mounts"

mount -t tmpfs -o "size=$(( (SIZE * 2 + MMAP_SIZE * 2) / MiB + 64 ))m" regions-bench-tmpfs "$TMPFS"

# ---------------------------------------------------------------- helpers

drop_caches() {
    sync
    echo 3 >/proc/sys/vm/drop_caches
}

# Resident pages of a file, in percent (fincore; "?" without it).
resident_pct() {
    command -v fincore >/dev/null || { echo "?"; return; }
    local pages size
    read -r pages size < <(fincore -nb -o PAGES,SIZE "$1" 2>/dev/null) || { echo "?"; return; }
    [ "${size:-0}" -gt 0 ] 2>/dev/null || { echo "?"; return; }
    echo $(( pages * 4096 * 100 / size ))
}

# A file of the run must have the size it was written with; anything else
# is a bug of the mount (reported with what the other host sees).
check_size() {
    local file=$1 sz again other=""
    sz=$(stat -c %s "$file" 2>&1) || true
    [ "$sz" = "$SIZE" ] && return 0
    sleep 1
    again=$(stat -c %s "$file" 2>&1) || true
    case "$file" in "$MNT1"/*) other="; through MNT2: $(stat -c %s "$MNT2${file#"$MNT1"}" 2>&1)" ;; esac
    fail "$file reports size $sz (1 s later: $again$other), but $SIZE bytes were written"
}

# fio_read FILE RW BS SECONDS -> "bytes_per_s iops". SECONDS 0: one pass
# over the file; N: N seconds, repeating passes (warm runs); oN: at most
# one pass and at most N seconds (cold random runs: fio's random map never
# repeats a block within a pass, so every read is of a block not read
# before). Buffered psync reads; --invalidate=0 so that fio does not drop
# the page cache itself (warm runs stay warm).
fio_read() {
    local file=$1 rw=$2 bs=$3 secs=$4 out extra=()
    check_size "$file"
    case "$secs" in
        0) ;;
        o*) extra=(--runtime="${secs#o}") ;;
        *) extra=(--time_based=1 --runtime="$secs") ;;
    esac
    out=$(fio --name=bench --filename="$file" --readonly --rw="$rw" --bs="$bs" \
        --ioengine=psync --direct=0 --invalidate=0 --size="$SIZE" --numjobs=1 \
        --randrepeat=1 "${extra[@]}" --output-format=terse --terse-version=3 2>"$LOGS/fio.err") ||
        { cat "$LOGS/fio.err" >&2; fail "fio $rw $bs on $file"; }
    # terse v3: 5 error, 6 read KiB, 7 read KiB/s, 8 read IOPS, 9 runtime ms
    awk -F';' '{ if ($5 != 0) exit 1; printf "%.0f %.0f\n", $7 * 1024, $8 }' <<<"$out" ||
        fail "fio reported an error on $file: $out"
    if [ -n "${BENCH_VERBOSE:-}" ]; then
        awk -F';' -v f="$file" -v rw="$rw" -v bs="$bs" -v s="$secs" \
            '{ printf "   fio %s %s %s (%s): %.2f GB/s %.0f IOPS\n", rw, bs, f, s, $7 * 1024 / 1e9, $8 }' <<<"$out" >&2
        echo "   resident: $(resident_pct "$file")%" >&2
    fi
}

# Median of the arguments (numbers).
median() {
    printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}

# fio_pair FILE_R FILE_T RW BS SECONDS: regions and tmpfs runs interleaved
# (R T R T ...), WARM_REPS of each, so that both see the same load ->
# "r_bytes_per_s r_iops t_bytes_per_s t_iops" (medians).
fio_pair() {
    local fr=$1 ft=$2 i r rb=() ri=() tb=() ti=()
    shift 2
    for ((i = 0; i < WARM_REPS; i++)); do
        r=$(fio_read "$fr" "$@"); rb+=("${r% *}"); ri+=("${r#* }")
        r=$(fio_read "$ft" "$@"); tb+=("${r% *}"); ti+=("${r#* }")
    done
    echo "$(median "${rb[@]}") $(median "${ri[@]}") $(median "${tb[@]}") $(median "${ti[@]}")"
}

# Value of key $2 in a line of key=value pairs $1.
kv() { tr ' ' '\n' <<<"$1" | awk -F= -v k="$2" '$1 == k { print $2 }'; }

# Results: RESULTS[key]=value; rows are added in order to ROWS.
declare -A R
CHECKS_FAILED=0
check() {
    if "$@"; then return 0; fi
    CHECKS_FAILED=$((CHECKS_FAILED + 1))
    return 1
}

# ---------------------------------------------------------------- data

say "writing test data: ${SIZE_MIB} MiB + ${MMAP_MIB} MiB of random bytes"
head -c "$SIZE" /dev/urandom >"$TMPFS/data"
head -c "$MMAP_SIZE" /dev/urandom >"$TMPFS/mmapw"
cp "$TMPFS/mmapw" "$TMPFS/mmapw.orig"

mkdir "$MNT1/remote" "$MNT1/local"
setfattr -n user.regions.persistent -v 1 "$MNT1/remote"
setfattr -n user.regions.persistent -v 1 "$MNT1/local"
setfattr -n user.regions.hostalloc -v 2 "$MNT1/remote"
setfattr -n user.regions.hostalloc -v 1 "$MNT1/local"

# Copies $1 to $2 with 1 MiB writes and fsync; prints bytes/s.
copy_in() {
    local t0 t1
    t0=$(date +%s.%N)
    dd if="$1" of="$2" bs=1M conv=fsync status=none || fail "cannot write $2"
    t1=$(date +%s.%N)
    awk -v b="$(stat -c %s "$1")" -v a="$t0" -v z="$t1" 'BEGIN { printf "%.0f\n", b / (z - a) }'
}

R[write_remote]=$(copy_in "$TMPFS/data" "$MNT1/remote/data")
R[write_local]=$(copy_in "$TMPFS/data" "$MNT1/local/data")
copy_in "$TMPFS/mmapw" "$MNT1/remote/mmapw" >/dev/null
# The tmpfs baseline of writes: the same copy within tmpfs.
R[write_tmpfs]=$(copy_in "$TMPFS/data" "$TMPFS/data.copy")
rm -f "$TMPFS/data.copy"

# Placement, as the manager and the open file see it.
hosts_of() { getfattr --only-values -n user.regions.hosts "$1" 2>/dev/null || echo "?"; }
INFO_REMOTE=$("$MF" info "$MNT1/remote/data" 2>&1 || true)
INFO_LOCAL=$("$MF" info "$MNT1/local/data" 2>&1 || true)
say "remote file: hosts=$(hosts_of "$MNT1/remote/data"); RINFO through MNT1: $INFO_REMOTE"
say "local file:  hosts=$(hosts_of "$MNT1/local/data"); RINFO through MNT1: $INFO_LOCAL"
check [ "$(kv "$INFO_REMOTE" hosts)" = 2 ] || warn "the remote file is not held by host 2 alone"
check [ "$(kv "$INFO_LOCAL" hosts)" = 1 ] || warn "the local file is not held by host 1 alone"
check [ "$(kv "$INFO_REMOTE" size)" = "$SIZE" ] || warn "the remote file has the wrong size"
if [ "$CACHE1" = passthrough ] && [ "$(kv "$INFO_LOCAL" passthrough)" != 1 ]; then
    warn "a read-only open of the local region is not served by FUSE passthrough (see $LOGS/mount1.log)"
fi

# ---------------------------------------------------------------- 1, 2: remote file

RF=$MNT1/remote/data
TF=$TMPFS/data

say "1. sequential 1 MiB reads, remote file (host 2) through MNT1 (host 1): cold, regions then tmpfs"
drop_caches
R[res_cold]=$(resident_pct "$RF")
r=$(fio_read "$RF" read 1M 0); R[seq_cold_r]=${r% *}
R[res_warm]=$(resident_pct "$RF")
drop_caches
r=$(fio_read "$TF" read 1M 0); R[seq_cold_t]=${r% *}
# The ceiling of any cold remote read here: a bare loopback TCP stream of
# memfd memory into a 1 MiB buffer (no FUSE, no page cache, no protocol).
R[tcp_stream]=$("$WORK/bin/tcp_stream" "$SIZE_MIB") || fail "tcp_stream"
say "   bare TCP stream: $(gbs "${R[tcp_stream]}")"

say "1. warm (median of $WARM_REPS, interleaved with tmpfs)"
# Dropping caches for the tmpfs cold run evicted the remote file: read it
# once more, unmeasured.
fio_read "$RF" read 1M 0 >/dev/null
R[res_warm2]=$(resident_pct "$RF")
read -r R[seq_warm_r] _ R[seq_warm_t] _ < <(fio_pair "$RF" "$TF" read 1M 0)
say "2. random 16 KiB reads, warm (${RAND_SECS} s each, median of $WARM_REPS, interleaved)"
read -r R[rand_warm_r] R[rand_warm_r_iops] R[rand_warm_t] R[rand_warm_t_iops] < <(fio_pair "$RF" "$TF" randread 16k "$RAND_SECS")
[ "${R[res_warm2]}" = "?" ] || [ "${R[res_warm2]}" -ge 95 ] || warn "only ${R[res_warm2]}% of the remote file was cached for the warm runs"

say "2. random 16 KiB reads, cold (one pass, at most ${RAND_SECS} s), regions then tmpfs"
drop_caches
r=$(fio_read "$RF" randread 16k "o$RAND_SECS"); R[rand_cold_r]=${r% *}; R[rand_cold_r_iops]=${r#* }
R[res_rand]=$(resident_pct "$RF")
drop_caches
r=$(fio_read "$TF" randread 16k "o$RAND_SECS"); R[rand_cold_t]=${r% *}; R[rand_cold_t_iops]=${r#* }

# ---------------------------------------------------------------- 3: local region

LF=$MNT1/local/data
say "3. local region (host 1) through MNT1: sequential 1 MiB, random 16 KiB (interleaved with tmpfs)"
drop_caches
read -r R[seq_local_r] _ R[seq_local_t] _ < <(fio_pair "$LF" "$TF" read 1M 0)
read -r R[rand_local_r] R[rand_local_r_iops] R[rand_local_t] R[rand_local_t_iops] < <(fio_pair "$LF" "$TF" randread 16k "$RAND_SECS")

# ---------------------------------------------------------------- 4: mmap faults

MMAP_PAGES=$((MMAP_SIZE / 4096))
say "4. mmap first-touch latency: $MMAP_PAGES pages in order, $RAND_PAGES at random (MADV_RANDOM)"
# mmap_run NAME MODE FILE ORDER PAGES: cold mapping, result line in R[NAME].
mmap_run() {
    local name=$1 mode=$2 file=$3 order=$4 pages=$5 out
    drop_caches
    out=$("$MF" "$mode" "$file" --order "$order" --pages "$pages" --seed 12345) ||
        fail "mmap_fault $mode $file"
    R[$name]=$out
}
mmap_run mr_seq_r read "$RF" seq "$MMAP_PAGES"
mmap_run mr_seq_t read "$TF" seq "$MMAP_PAGES"
mmap_run mr_rand_r read "$RF" rand "$RAND_PAGES"
mmap_run mr_rand_t read "$TF" rand "$RAND_PAGES"
mmap_run mw_seq_r write "$MNT1/remote/mmapw" seq "$MMAP_PAGES"
mmap_run mw_seq_t write "$TMPFS/mmapw" seq "$MMAP_PAGES"
mmap_run mw_rand_r write "$MNT1/remote/mmapw" rand "$RAND_PAGES"
mmap_run mw_rand_t write "$TMPFS/mmapw" rand "$RAND_PAGES"

# ---------------------------------------------------------------- checks

say "checking what reads back"
for k in mr_seq mr_rand mw_seq mw_rand; do
    a=$(kv "${R[${k}_r]}" sum)
    b=$(kv "${R[${k}_t]}" sum)
    check [ -n "$a" ] && check [ "$a" = "$b" ] ||
        warn "mmap $k: checksum through regions ($a) differs from tmpfs ($b)"
done

drop_caches
# Cold samples of the remote file through host 1, at random 1 MiB offsets.
samples_ok=0
for ((i = 0; i < CMP_SAMPLES; i++)); do
    off=$(( (RANDOM * 32768 + RANDOM) % SIZE_MIB ))
    [ $i = 0 ] && off=0
    [ $i = 1 ] && off=$((SIZE_MIB - 1))
    if cmp -s <(dd if="$RF" bs=1M skip="$off" count=1 status=none) \
              <(dd if="$TF" bs=1M skip="$off" count=1 status=none); then
        samples_ok=$((samples_ok + 1))
    else
        warn "remote file through MNT1 differs from what was written in MiB $off"
    fi
done
check [ "$samples_ok" = "$CMP_SAMPLES" ] || true
# Whole files through the other host: the remote file (local to host 2),
# the local region of host 1 (remote to host 2), and the mmap writes made
# on host 1, which must have reached host 2's memory.
cmp_whole() {
    if cmp "$1" "$2" >"$LOGS/cmp.out" 2>&1; then
        return 0
    fi
    warn "$1 differs from $2: $(cat "$LOGS/cmp.out")"
    return 1
}
W_REMOTE=ok; W_LOCAL=ok; W_MMAP=ok
check cmp_whole "$MNT2/remote/data" "$TF" || W_REMOTE=DIFFERS
check cmp_whole "$MNT2/local/data" "$TF" || W_LOCAL=DIFFERS
check cmp_whole "$MNT2/remote/mmapw" "$TMPFS/mmapw" || W_MMAP=DIFFERS
if cmp -s "$TMPFS/mmapw" "$TMPFS/mmapw.orig"; then
    warn "the mmap writes changed nothing in tmpfs: the write check proves nothing"
    CHECKS_FAILED=$((CHECKS_FAILED + 1))
fi

LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
say "load after: $LOAD_AFTER"

# ---------------------------------------------------------------- table

gbs() { awk -v v="$1" 'BEGIN { printf "%.2f GB/s", v / 1e9 }'; }
mbs() { awk -v v="$1" -v i="$2" 'BEGIN { printf "%.0f MB/s %.1fk IOPS", v / 1e6, i / 1e3 }'; }
us() { awk -v v="$1" 'BEGIN { printf (v < 10 ? "%.2f us" : "%.1f us"), v }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "-" }'; }
# met A B MIN: "yes"/"NO" for A/B >= MIN.
met() { awk -v a="$1" -v b="$2" -v m="$3" 'BEGIN { print (b > 0 && a / b >= m) ? "yes" : "NO" }'; }

ROWS=()
row() { ROWS+=("$1|$2|$3|$4|$5|$6"); }
thr_row() { # name regions tmpfs target(min ratio or "")
    local name=$1 r=$2 t=$3 min=$4 fmt=$5 ri=${6:-0} ti=${7:-0} vr vt
    if [ "$fmt" = gb ]; then vr=$(gbs "$r"); vt=$(gbs "$t"); else vr=$(mbs "$r" "$ri"); vt=$(mbs "$t" "$ti"); fi
    if [ -n "$min" ]; then
        row "$name" "$vr" "$vt" "$(ratio "$r" "$t")" ">= ${min}x" "$(met "$r" "$t" "$min")"
    else
        row "$name" "$vr" "$vt" "$(ratio "$r" "$t")" "-" "info"
    fi
}
lat_rows() { # name key [mean]
    local name=$1 k=$2 p ps=(p50 p99)
    [ "${3:-}" = mean ] && ps+=(mean)
    for p in "${ps[@]}"; do
        local a b
        a=$(kv "${R[${k}_r]}" "${p}_us")
        b=$(kv "${R[${k}_t]}" "${p}_us")
        row "$name $p" "$(us "$a")" "$(us "$b")" "$(ratio "$a" "$b")" "-" "info"
    done
}

thr_row "seq read 1 MiB, remote, cold" "${R[seq_cold_r]}" "${R[seq_cold_t]}" 0.5 gb
thr_row "  bare TCP stream (ceiling)" "${R[tcp_stream]}" "${R[seq_cold_t]}" "" gb
row "  remote cold / bare TCP" "" "" "$(ratio "${R[seq_cold_r]}" "${R[tcp_stream]}")" "-" "info"
thr_row "seq read 1 MiB, remote, warm" "${R[seq_warm_r]}" "${R[seq_warm_t]}" 0.9 gb
thr_row "rand read 16 KiB, remote, cold" "${R[rand_cold_r]}" "${R[rand_cold_t]}" "" mb "${R[rand_cold_r_iops]}" "${R[rand_cold_t_iops]}"
thr_row "rand read 16 KiB, remote, warm" "${R[rand_warm_r]}" "${R[rand_warm_t]}" "" mb "${R[rand_warm_r_iops]}" "${R[rand_warm_t_iops]}"
thr_row "seq read 1 MiB, local region" "${R[seq_local_r]}" "${R[seq_local_t]}" 0.9 gb
thr_row "rand read 16 KiB, local region" "${R[rand_local_r]}" "${R[rand_local_t]}" 0.9 mb "${R[rand_local_r_iops]}" "${R[rand_local_t_iops]}"
lat_rows "mmap read fault, in order" mr_seq mean
lat_rows "mmap read fault, random" mr_rand
lat_rows "mmap write fault, in order" mw_seq mean
lat_rows "mmap write fault, random" mw_rand
thr_row "seq write 1 MiB + fsync, remote" "${R[write_remote]}" "${R[write_tmpfs]}" "" gb
thr_row "seq write 1 MiB + fsync, local" "${R[write_local]}" "${R[write_tmpfs]}" "" gb

w1=11; w2=7; w3=7; w4=5; w5=6
for line in "${ROWS[@]}"; do
    IFS='|' read -r a b c d e f <<<"$line"
    [ ${#a} -gt $w1 ] && w1=${#a}
    [ ${#b} -gt $w2 ] && w2=${#b}
    [ ${#c} -gt $w3 ] && w3=${#c}
    [ ${#d} -gt $w4 ] && w4=${#d}
    [ ${#e} -gt $w5 ] && w5=${#e}
done

echo
echo "regionfs benchmark: file ${SIZE_MIB} MiB, mmap file ${MMAP_MIB} MiB, random runs ${RAND_SECS} s, warm = median of ${WARM_REPS}"
echo "MNT1 (host 1) --cache $CACHE1; remote file on host 2's daemon, local region on host 1's; tcp transport on loopback"
echo "load before: $LOAD_BEFORE   after: $LOAD_AFTER   ($(nproc) cpus, $(uname -r)); ${SECONDS} s so far"
if awk -v l="${LOAD_BEFORE%% *}" -v n="$(nproc)" 'BEGIN { exit !(l > 0.5 * n) }'; then
    echo "NOTE: the machine was busy before the run (load ${LOAD_BEFORE%% *} on $(nproc) cpus): expect noisy numbers"
fi
echo "page cache of the remote file on host 1: ${R[res_cold]}% before the cold run, ${R[res_warm]}% after it; ${R[res_rand]}% after the cold random run"
printf "%-${w1}s | %${w2}s | %${w3}s | %${w4}s | %-${w5}s | %s\n" measurement regions tmpfs ratio target "met?"
printf '%s\n' "$(printf '%*s' $((w1 + w2 + w3 + w4 + w5 + 22)) '' | tr ' ' -)"
for line in "${ROWS[@]}"; do
    IFS='|' read -r a b c d e f <<<"$line"
    printf "%-${w1}s | %${w2}s | %${w3}s | %${w4}s | %-${w5}s | %s\n" "$a" "$b" "$c" "$d" "$e" "$f"
done
echo
echo "ratio = regions / tmpfs (for latencies lower is better). tmpfs 'cold' is warm: its pages never leave memory."
echo "cold random: one pass at most (no block read twice), so every read misses the page cache unless readahead brought it in."
echo "mmap in order: default readahead and fault-around, so most touches do not fault (p50); p99 and mean carry the faults."
echo "mmap random: MADV_RANDOM, one fault per page; writes end with msync (regions ${R[mw_seq_r]##*msync_ms=} ms in order, ${R[mw_rand_r]##*msync_ms=} ms random)."
echo "checks: cold 1 MiB samples through MNT1 ${samples_ok}/${CMP_SAMPLES} equal; whole remote file via MNT2 $W_REMOTE; local region via MNT2 $W_LOCAL; mmap writes via MNT2 $W_MMAP; mmap checksums $( [ "$CHECKS_FAILED" = 0 ] && echo equal || echo 'see warnings')"

# Results that cannot be right.
sane=1
for k in seq_cold_r seq_warm_r seq_local_r rand_cold_r rand_warm_r rand_local_r; do
    v=${R[$k]:-0}
    if awk -v v="$v" 'BEGIN { exit !(v <= 0 || v > 200e9) }'; then
        warn "implausible result $k = $v B/s"
        sane=0
    fi
done
if awk -v a="${R[seq_cold_r]}" -v b="${R[seq_warm_r]}" 'BEGIN { exit !(a > 1.5 * b) }'; then
    warn "the cold remote read is much faster than the warm one: was the cache really dropped?"
    sane=0
fi
if [ "${R[res_cold]}" != "?" ] && [ "${R[res_cold]}" -gt 5 ]; then
    warn "${R[res_cold]}% of the remote file was still cached before the cold run"
    sane=0
fi
[ "$sane" = 1 ] || CHECKS_FAILED=$((CHECKS_FAILED + 1))

if [ "$CHECKS_FAILED" != 0 ]; then
    echo "RESULT: $CHECKS_FAILED check(s) failed (see the warnings above); logs in $LOGS"
    exit 1
fi
echo "RESULT: all checks passed"
