#!/usr/bin/env bash
# regionfs benchmark: reads, writes, mmap faults, small files and manager
# requests through a real REGIONFS mount, each next to tmpfs (and, where
# stated, sshfs and a bare TCP stream) measured in the same run.
#
#   bash benches/regionfs.sh [--size 2G] [--quick] [--cache writeback|passthrough]
#                            [--keep-logs]
#
# Starts, in a temporary directory, one regions-manager, two regions-daemon
# (host 1 and host 2) and two `regionfs mount`s (host 1 at MNT1, host 2 at
# MNT2), plus a tmpfs as the baseline, and an sshd on a free loopback port
# (own config and throwaway keys in the temporary directory) with an sshfs
# mount of a directory of that tmpfs (root@127.0.0.1), and the FUSE floor
# (regions-fuse-floor, tests/src/bin/fuse_floor.rs: every file a memfd behind
# FUSE, answered at once, with regionfs's kernel settings; what it does not
# reach, no FUSE file system reaches on this machine), then measures:
#
#   1. sequential 1 MiB reads (fio, psync, buffered) of a --size file held by
#      host 2's daemon, read through MNT1: cold (after drop_caches) and warm;
#      next to the ceiling of any cold remote read on this machine, a bare
#      loopback TCP stream of memfd memory (benches/tcp_stream.c; with
#      --rtt, the bare 4 KiB round trip that bounds a remote mmap fault);
#   2. random 16 KiB reads of the same file, cold and warm (time-based);
#   3. a wholly local region (hostalloc=1) read through MNT1 (from its
#      segment memfd; with --cache passthrough by FUSE passthrough):
#      sequential 1 MiB and random 16 KiB;
#   4. mmap first-touch latency of 4 KiB pages (benches/mmap_fault.c,
#      compiled here with cc): reads of the remote file and writes to another
#      remote file, each on a cold, fresh MAP_SHARED mapping, in page order
#      (with readahead) and in random order (MADV_RANDOM, one fault per page);
#   5. 16 KiB writes (fio, psync, one job, --size bytes) through MNT1 to a
#      region on this host (hostalloc=1) and on the other host
#      (hostalloc=2), to tmpfs and to sshfs: "create" (sequential extending
#      writes into a new file, fsync on close), buffered sequential and
#      random writes over the existing file, O_DIRECT sequential and random
#      writes; every write run ends with an fsync that is part of its time;
#      sequential runs are one pass (capped in time), random ones time-based;
#   6. cold sequential 1 MiB and random 16 KiB reads of the file of 1 and 2
#      on sshfs (the same data, from the sshd's tmpfs);
#   7. small files (benches/small_files.c, 2,000 files of 1 KiB, one
#      process per phase, one file at a time): create+write+close,
#      open+read+close (right after, and cold after drop_caches), unlink,
#      in files/s, on MNT1 (default placement: this host), tmpfs and sshfs,
#      with the manager requests of each phase on MNT1;
#   (1-5 and 7 are also run on the FUSE floor, each right after its regions
#   and tmpfs runs;)
#   8. manager requests (namespace and region requests, counted from the
#      manager's metrics page) for one sequential write
#      (dd bs=1M conv=fsync) of 1 GiB into a new file through MNT1 (default
#      placement: this host).
#
# It checks that what is read back is what was written (cmp of cold samples,
# whole-file cmp through the other host, mmap checksums, fio verify headers
# of 16 KiB buffered and O_DIRECT writes read back through MNT2, the small
# files' contents, cmp of the manager step's file through MNT2), and prints
# three tables: measurement | regions | tmpfs | ratio | target | met?, then
# the same against sshfs, then against the FUSE floor (where a target of
# the first table is above the floor itself, it is met within 10% of it).
#
# --quick: a 256 MiB file (unless --size), 2 s random runs, sequential
# write runs capped at 5 s, no repeats: about 2-3 minutes on 2 cores. The
# full run (2 GiB) takes about 7. BENCH_VERBOSE=1 prints every fio run;
# REGIONS_BIN_DIR and REGIONS_BENCH_SSHD name other binaries.
#
# Needs root (FUSE, tmpfs, drop_caches), the release binaries
# (cargo build --release --bins), fio, setfattr/getfattr, sshfs, sshd and
# ssh (installed with apt-get when missing: fio attr sshfs openssh-server
# openssh-client) and cc. Everything started is stopped by PID and every
# mount is unmounted on exit, Ctrl-C included.
#
# Exit status: 0 when the run completed and every check passed (targets
# may still be unmet: see the table), 1 when a check or a step failed,
# 2 for a usage or environment problem (sshd that cannot start included).

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${REGIONS_BIN_DIR:-$ROOT/target/release}

SIZE_ARG=2G
SIZE_SET=0
QUICK=0
# MNT1 runs the default mount mode unless --cache says otherwise.
CACHE1=writeback
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
    SEQ_CAP=5
else
    SIZE=$(parse_size "$SIZE_ARG")
    RAND_SECS=5
    WARM_REPS=3
    MMAP_SIZE=$((256 * MiB))
    RAND_PAGES=4096
    CMP_SAMPLES=8
    SEQ_CAP=20
fi
# Writes (5): sequential runs are one pass over the file, at most SEQ_CAP
# seconds (sshfs is slow); random runs RAND_SECS seconds.
SMALL_N=2000
SMALL_SIZE=1024
# Whole MiB (regions are whole 128 KiB chunks; passthrough wants the file
# to fill its segment exactly).
SIZE=$(( (SIZE + MiB - 1) / MiB * MiB ))
[ "$SIZE" -ge $((16 * MiB)) ] || { echo "regionfs.sh: --size must be at least 16M" >&2; exit 2; }
[ "$MMAP_SIZE" -le "$SIZE" ] || MMAP_SIZE=$SIZE
SIZE_MIB=$((SIZE / MiB))
MMAP_MIB=$((MMAP_SIZE / MiB))
# The manager-request step (8) writes 1 GiB (the file of the run, repeated
# when smaller: fixed per-file requests would be scaled up otherwise); the
# fio verify step writes up to 64 MiB.
MGR_MIB=1024
VERIFY_MIB=$(( SIZE_MIB < 64 ? SIZE_MIB : 64 ))
case "$CACHE1" in passthrough|writeback) ;; *) echo "regionfs.sh: --cache is passthrough or writeback" >&2; exit 2 ;; esac

# ---------------------------------------------------------------- environment

missing=()
for b in regions-manager regions-daemon regionfs regions-fuse-floor; do
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

SSHD=${REGIONS_BENCH_SSHD:-/usr/sbin/sshd}
need_pkgs=()
command -v fio >/dev/null || need_pkgs+=(fio)
command -v taskset >/dev/null || need_pkgs+=(util-linux)
{ command -v setfattr >/dev/null && command -v getfattr >/dev/null; } || need_pkgs+=(attr)
command -v sshfs >/dev/null || need_pkgs+=(sshfs)
command -v curl >/dev/null || need_pkgs+=(curl)
[ -x "$SSHD" ] || need_pkgs+=(openssh-server)
{ command -v ssh >/dev/null && command -v ssh-keygen >/dev/null; } || need_pkgs+=(openssh-client)
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
# once warm; the write runs add a file on each host, one in tmpfs and one
# behind sshfs (deleted before the steps that follow).
need_kib=$(( (SIZE * 9 + MMAP_SIZE * 4) / 1024 + 256 * 1024 ))
[ "$SIZE_MIB" -ge 1024 ] || need_kib=$(( need_kib + 1024 * 1024 ))
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
SSHFS=$WORK/sshfs          # sshfs mount of $TMPFS/export
FLOOR=$WORK/floor          # the FUSE floor (regions-fuse-floor: files in memory)
SSHDIR=$WORK/ssh           # sshd config, host key, client key
LOGS=$WORK/logs
mkdir -p "$MNT1" "$MNT2" "$TMPFS" "$SSHFS" "$FLOOR" "$SSHDIR" "$LOGS" "$WORK/manager"
chmod 700 "$SSHDIR"
PIDS=()          # started processes, in start order
MOUNT_PIDS=()    # the regionfs and sshfs mount processes among them
SSHD_PID=""
SSH_CHILD_PIDS=()  # the ssh client that sshfs started
MADE_RUN_SSHD=0
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
    for m in "$SSHFS" "$FLOOR" "$MNT1" "$MNT2" "$TMPFS"; do
        if is_mounted "$m"; then
            umount -l "$m" 2>/dev/null || warn "cannot unmount $m"
        fi
    done
    # The ssh client of sshfs ends with it; the sshd's session processes
    # (its children) with their client.
    for pid in "${SSH_CHILD_PIDS[@]}"; do
        kill -0 "$pid" 2>/dev/null || continue
        kill -TERM "$pid" 2>/dev/null
        wait_gone "$pid" 5 || kill -KILL "$pid" 2>/dev/null
    done
    if [ -n "$SSHD_PID" ] && kill -0 "$SSHD_PID" 2>/dev/null; then
        for pid in $(pgrep -P "$SSHD_PID" 2>/dev/null); do
            kill -TERM "$pid" 2>/dev/null
            wait_gone "$pid" 5 || kill -KILL "$pid" 2>/dev/null
        done
    fi
    local i
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        pid=${PIDS[$i]}
        kill -0 "$pid" 2>/dev/null || continue
        kill -TERM "$pid" 2>/dev/null
        wait_gone "$pid" 10 || kill -KILL "$pid" 2>/dev/null
    done
    [ "$MADE_RUN_SSHD" = 1 ] && rmdir /run/sshd 2>/dev/null
    if is_mounted "$SSHFS" || is_mounted "$FLOOR" || is_mounted "$MNT1" || is_mounted "$MNT2" || is_mounted "$TMPFS"; then
        warn "something is still mounted under $WORK; leaving it in place"
    elif [ "$rc" = 1 ] || [ "$KEEP_LOGS" = 1 ]; then
        rm -rf "$WORK/manager" "$MNT1" "$MNT2" "$TMPFS" "$SSHFS" "$FLOOR" "$SSHDIR" "$WORK/bin"
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
cc -O2 -Wall -o "$WORK/bin/small_files" "$ROOT/benches/small_files.c" ||
    fail "cannot compile benches/small_files.c"
SF=$WORK/bin/small_files

# Created unreadable to others (the components refuse a secret others may read).
(umask 077 && head -c 48 /dev/urandom | base64 | tr -d '\n' >"$WORK/secret")

# Pools: host 2 holds the remote file, the mmap write file and the remote
# write file; host 1 the local region, the local write file, the small
# files (a 128 KiB chunk each at most) and the manager step's file.
DAEMON_MIB=$(( SIZE_MIB * 2 + MMAP_MIB * 2 + MGR_MIB + 512 ))

say "starting the manager, daemons (${DAEMON_MIB}M each) and mounts in $WORK"
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null ||
        echo $(( 20000 + RANDOM % 30000 ))
}
# The manager's request counters (its metrics page) count the namespace and region requests
# of steps 7 and 8 (logging each request instead would cost the requests themselves).
MGR_METRICS=127.0.0.1:$(free_port)
start_node manager "$BIN/regions-manager" --listen 127.0.0.1:0 --data-dir "$WORK/manager" \
    --secret-file "$WORK/secret" --ready-file "$WORK/manager.ready" --metrics-listen "$MGR_METRICS"
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

mount -t tmpfs -o "size=$(( (SIZE * 4 + MMAP_SIZE * 2) / MiB + 128 ))m" regions-bench-tmpfs "$TMPFS"

# The FUSE floor: the same kernel settings as regionfs, files in memfds, nothing else
# (tests/src/bin/fuse_floor.rs). What it cannot reach, no FUSE file system reaches here.
start_node floor "$BIN/regions-fuse-floor" "$FLOOR"
MOUNT_PIDS+=("$LAST_PID")
n=100
while [ $n -gt 0 ] && ! grep -q ready "$LOGS/floor.log" 2>/dev/null; do
    kill -0 "$LAST_PID" 2>/dev/null || { tail -n 20 "$LOGS/floor.log" >&2; fail "the FUSE floor exited"; }
    sleep 0.1
    n=$((n - 1))
done
is_mounted "$FLOOR" || fail "the FUSE floor did not mount at $FLOOR (log $LOGS/floor.log)"

# ---------------------------------------------------------------- sshfs

# An sshd of its own on a free loopback port (config, host key and client
# key in $SSHDIR), and sshfs of $TMPFS/export at $SSHFS as root@127.0.0.1.
# No sshd, no run: exit 2.
sshd_fail() {
    echo "regionfs.sh: cannot provide the sshfs baseline: $*" >&2
    [ -s "$LOGS/sshd.log" ] && { echo "sshd log ($LOGS/sshd.log):" >&2; tail -n 20 "$LOGS/sshd.log" >&2; }
    [ -s "$LOGS/sshfs.log" ] && { echo "sshfs log ($LOGS/sshfs.log):" >&2; tail -n 20 "$LOGS/sshfs.log" >&2; }
    KEEP_LOGS=1
    exit 2
}
SSH_OPTS=(-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes
          -o IdentityFile="$SSHDIR/id" -o IdentitiesOnly=yes -o ConnectTimeout=5 -o LogLevel=ERROR)
ssh-keygen -q -t ed25519 -N '' -C regions-bench-host -f "$SSHDIR/host_key" || sshd_fail "ssh-keygen (host key) failed"
ssh-keygen -q -t ed25519 -N '' -C regions-bench-client -f "$SSHDIR/id" || sshd_fail "ssh-keygen (client key) failed"
cp "$SSHDIR/id.pub" "$SSHDIR/authorized_keys"
# Debian's sshd wants its privilege separation directory.
if [ ! -d /run/sshd ]; then
    mkdir -p /run/sshd && chmod 755 /run/sshd && MADE_RUN_SSHD=1
fi
say "starting sshd on loopback and sshfs at $SSHFS"
SSH_PORT=""
for try in 1 2 3 4 5; do
    port=$(free_port)
    printf '%s\n' "Port $port" "ListenAddress 127.0.0.1" "HostKey $SSHDIR/host_key" "PidFile none" \
        "AuthorizedKeysFile $SSHDIR/authorized_keys" "StrictModes no" "PermitRootLogin prohibit-password" \
        "PubkeyAuthentication yes" "PasswordAuthentication no" "KbdInteractiveAuthentication no" \
        "UsePAM no" "X11Forwarding no" "PrintMotd no" "Subsystem sftp internal-sftp" >"$SSHDIR/sshd_config"
    "$SSHD" -t -f "$SSHDIR/sshd_config" >"$LOGS/sshd.log" 2>&1 ||
        sshd_fail "$SSHD rejects its configuration ($SSHDIR/sshd_config)"
    start_node sshd "$SSHD" -D -e -f "$SSHDIR/sshd_config"
    SSHD_PID=$LAST_PID
    n=50
    while [ $n -gt 0 ] && kill -0 "$SSHD_PID" 2>/dev/null && ! grep -q "Server listening" "$LOGS/sshd.log"; do
        sleep 0.1
        n=$((n - 1))
    done
    if kill -0 "$SSHD_PID" 2>/dev/null && grep -q "Server listening" "$LOGS/sshd.log"; then
        SSH_PORT=$port
        break
    fi
    warn "sshd did not start on port $port (try $try): $(tail -n 1 "$LOGS/sshd.log")"
    kill -TERM "$SSHD_PID" 2>/dev/null
    wait_gone "$SSHD_PID" 5 || kill -KILL "$SSHD_PID" 2>/dev/null
    SSHD_PID=""
done
[ -n "$SSH_PORT" ] || sshd_fail "sshd ($SSHD) does not start on a loopback port"
ssh -p "$SSH_PORT" "${SSH_OPTS[@]}" root@127.0.0.1 true >"$LOGS/ssh.log" 2>&1 ||
    sshd_fail "ssh root@127.0.0.1 -p $SSH_PORT with the throwaway key fails: $(tail -n 3 "$LOGS/ssh.log")"
mkdir -p "$TMPFS/export"
start_node sshfs sshfs -f -p "$SSH_PORT" \
    -o StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,IdentityFile="$SSHDIR/id",BatchMode=yes,IdentitiesOnly=yes,LogLevel=ERROR \
    root@127.0.0.1:"$TMPFS/export" "$SSHFS"
MOUNT_PIDS+=("$LAST_PID")
SSHFS_PID=$LAST_PID
n=100
while [ $n -gt 0 ] && kill -0 "$SSHFS_PID" 2>/dev/null && ! is_mounted "$SSHFS"; do
    sleep 0.1
    n=$((n - 1))
done
is_mounted "$SSHFS" || sshd_fail "sshfs root@127.0.0.1:$TMPFS/export does not mount at $SSHFS"
mapfile -t SSH_CHILD_PIDS < <(pgrep -P "$SSHFS_PID" 2>/dev/null || true)
echo sshfs-ok >"$TMPFS/export/probe"
[ "$(cat "$SSHFS/probe" 2>/dev/null)" = sshfs-ok ] || sshd_fail "a file written to $TMPFS/export does not read back through $SSHFS"
rm -f "$TMPFS/export/probe"

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

# Formatting of results (also used in progress lines).
gbs() { awk -v v="$1" 'BEGIN { printf "%.2f GB/s", v / 1e9 }'; }
mbs() { awk -v v="$1" -v i="$2" 'BEGIN { printf "%.0f MB/s %.1fk IOPS", v / 1e6, i / 1e3 }'; }
us() { awk -v v="$1" 'BEGIN { printf (v < 10 ? "%.2f us" : "%.1f us"), v }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "-" }'; }
# met A B MIN: "yes"/"NO" for A/B >= MIN.
met() { awk -v a="$1" -v b="$2" -v m="$3" 'BEGIN { print (b > 0 && a / b >= m) ? "yes" : "NO" }'; }
per_s() { awk -v v="$1" 'BEGIN { printf "%.0f/s", v }'; }

# fio_write FILE RW DIRECT SECS [FIO OPTIONS...] -> "bytes_per_s iops".
# 16 KiB psync writes, one job, over the first SIZE bytes of FILE; DIRECT
# 1 for O_DIRECT. SECS oN: one pass, at most N seconds; N: N seconds,
# time-based. Every run ends with an fsync (end_fsync), inside fio's time;
# no preallocation (fallocate=none). The file's page cache is left to fio
# (invalidated at open).
fio_write() {
    local file=$1 rw=$2 direct=$3 secs=$4 out extra=() t0 t1
    shift 4
    case "$secs" in
        o*) extra=(--runtime="${secs#o}") ;;
        *) extra=(--time_based=1 --runtime="$secs") ;;
    esac
    t0=$(date +%s.%N)
    out=$(fio --name=bench --filename="$file" --rw="$rw" --bs=16k --ioengine=psync \
        --direct="$direct" --size="$SIZE" --numjobs=1 --fallocate=none --end_fsync=1 \
        --randrepeat=1 "${extra[@]}" "$@" --output-format=terse --terse-version=3 2>"$LOGS/fio.err") ||
        { cat "$LOGS/fio.err" >&2; fail "fio $rw (direct=$direct) on $file"; }
    t1=$(date +%s.%N)
    # terse v3: 5 error, 47 write KiB, 48 write KiB/s, 49 write IOPS, 50 runtime ms
    awk -F';' '{ if ($5 != 0) exit 1; printf "%.0f %.0f\n", $48 * 1024, $49 }' <<<"$out" ||
        fail "fio reported an error on $file: $out"
    if [ -n "${BENCH_VERBOSE:-}" ]; then
        awk -F';' -v f="$file" -v rw="$rw" -v d="$direct" -v s="$secs" -v w="$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" \
            '{ printf "   fio %s direct=%s %s (%s): %.0f MB/s %.0f IOPS, %.0f MiB in %d ms (%.2f s wall with fio start)\n", rw, d, f, s, $48 * 1024 / 1e6, $49, $47 / 1024, $50, w }' <<<"$out" >&2
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
# The FUSE floor's copy: each read and fault below is measured on it right after regions and
# tmpfs, and so are the writes and small files (the third table).
FF=$FLOOR/data
copy_in "$TMPFS/data" "$FF" >/dev/null

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
drop_caches
r=$(fio_read "$FF" read 1M 0); R[seq_cold_f]=${r% *}
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
fio_read "$FF" read 1M 0 >/dev/null
r=$(fio_read "$FF" randread 16k "$RAND_SECS"); R[rand_warm_f]=${r% *}; R[rand_warm_f_iops]=${r#* }
[ "${R[res_warm2]}" = "?" ] || [ "${R[res_warm2]}" -ge 95 ] || warn "only ${R[res_warm2]}% of the remote file was cached for the warm runs"

say "2. random 16 KiB reads, cold (one pass, at most ${RAND_SECS} s), regions then tmpfs"
drop_caches
r=$(fio_read "$RF" randread 16k "o$RAND_SECS"); R[rand_cold_r]=${r% *}; R[rand_cold_r_iops]=${r#* }
R[res_rand]=$(resident_pct "$RF")
drop_caches
r=$(fio_read "$TF" randread 16k "o$RAND_SECS"); R[rand_cold_t]=${r% *}; R[rand_cold_t_iops]=${r#* }
drop_caches
r=$(fio_read "$FF" randread 16k "o$RAND_SECS"); R[rand_cold_f]=${r% *}; R[rand_cold_f_iops]=${r#* }

# ---------------------------------------------------------------- 3: local region

LF=$MNT1/local/data
say "3. local region (host 1) through MNT1: sequential 1 MiB, random 16 KiB (interleaved with tmpfs)"
drop_caches
read -r R[seq_local_r] _ R[seq_local_t] _ < <(fio_pair "$LF" "$TF" read 1M 0)
read -r R[rand_local_r] R[rand_local_r_iops] R[rand_local_t] R[rand_local_t_iops] < <(fio_pair "$LF" "$TF" randread 16k "$RAND_SECS")
drop_caches
r=$(fio_read "$FF" read 1M 0); R[seq_local_f]=${r% *}
r=$(fio_read "$FF" randread 16k "$RAND_SECS"); R[rand_local_f]=${r% *}; R[rand_local_f_iops]=${r#* }

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
mmap_run mr_rand_f read "$FF" rand "$RAND_PAGES"
rm -f "$FF"
# The floor of a remote 4 KiB fault: the FUSE floor's fault plus a bare 4 KiB round trip,
# the faster of two runs: both ends on one CPU, and placed by the scheduler (on an idle
# virtual machine a wake-up on the other CPU can cost tens of microseconds).
rtt_one=$(taskset -c 0 "$WORK/bin/tcp_stream" --rtt 20000) || fail "tcp_stream --rtt (one CPU)"
rtt_any=$("$WORK/bin/tcp_stream" --rtt 20000) || fail "tcp_stream --rtt"
R[tcp_rtt]=$(awk -v a="$rtt_one" -v b="$rtt_any" 'BEGIN { print (a < b) ? a : b }')
say "   bare 4 KiB TCP round trip (median): one CPU $(us "$rtt_one"), scheduler's placement $(us "$rtt_any")"
mmap_run mw_seq_r write "$MNT1/remote/mmapw" seq "$MMAP_PAGES"
mmap_run mw_seq_t write "$TMPFS/mmapw" seq "$MMAP_PAGES"
mmap_run mw_rand_r write "$MNT1/remote/mmapw" rand "$RAND_PAGES"
mmap_run mw_rand_t write "$TMPFS/mmapw" rand "$RAND_PAGES"

# ---------------------------------------------------------------- 5: writes

# Write targets: a region on this host (MNT1/local: hostalloc=1) and on the
# other host (MNT1/remote: hostalloc=2), both through MNT1; tmpfs; sshfs.
declare -A WF=([this]="$MNT1/local/w" [other]="$MNT1/remote/w" [floor]="$FLOOR/w" [tmpfs]="$TMPFS/w" [sshfs]="$SSHFS/w")
WTARGETS=(this other floor tmpfs sshfs)
WTESTS=(create seqbuf randbuf seqdir randdir)
declare -A WNAME=([create]="create (new file, fsync on close)" [seqbuf]="seq, buffered" [randbuf]="random, buffered"
                  [seqdir]="seq, O_DIRECT" [randdir]="random, O_DIRECT")
say "5. 16 KiB writes (fio psync, 1 job, ${SIZE_MIB} MiB; seq: one pass, at most ${SEQ_CAP} s; random: ${RAND_SECS} s): this host, other host, tmpfs, sshfs"
for test in "${WTESTS[@]}"; do
    for t in "${WTARGETS[@]}"; do
        f=${WF[$t]}
        case $test in
            create) rm -f "$f"; args=(write 0 "o$SEQ_CAP" --create_on_open=1 --fsync_on_close=1) ;;
            seqbuf) args=(write 0 "o$SEQ_CAP") ;;
            randbuf) args=(randwrite 0 "$RAND_SECS") ;;
            seqdir) args=(write 1 "o$SEQ_CAP") ;;
            randdir) args=(randwrite 1 "$RAND_SECS") ;;
        esac
        [ "$test" = create ] && [ -e "$f" ] && fail "$f is still there after rm"
        drop_caches
        r=$(fio_write "$f" "${args[@]}")
        R[w_${test}_$t]=${r% *}
        R[w_${test}_${t}_iops]=${r#* }
    done
    say "   ${WNAME[$test]}: this host $(mbs "${R[w_${test}_this]}" "${R[w_${test}_this_iops]}"), other host $(mbs "${R[w_${test}_other]}" "${R[w_${test}_other_iops]}"), FUSE floor $(mbs "${R[w_${test}_floor]}" "${R[w_${test}_floor_iops]}"), tmpfs $(mbs "${R[w_${test}_tmpfs]}" "${R[w_${test}_tmpfs_iops]}"), sshfs $(mbs "${R[w_${test}_sshfs]}" "${R[w_${test}_sshfs_iops]}")"
    if [ "$test" = create ]; then
        for t in this other; do
            sz=$(stat -c %s "${WF[$t]}")
            [ "$sz" = "$SIZE" ] || warn "${WF[$t]}: $sz bytes after the create run, not $SIZE (capped at ${SEQ_CAP} s?)"
        done
        sz=$(stat -c %s "${WF[sshfs]}")
        [ "$sz" = "$SIZE" ] || say "   (sshfs create capped at ${SEQ_CAP} s: $((sz / MiB)) MiB written)"
        INFO_WTHIS=$("$MF" info "${WF[this]}" 2>&1 || true)
        INFO_WOTHER=$("$MF" info "${WF[other]}" 2>&1 || true)
        say "   write file on this host: RINFO $INFO_WTHIS"
        say "   write file on the other host: RINFO $INFO_WOTHER"
        check [ "$(kv "$INFO_WTHIS" hosts)" = 1 ] || warn "the write file of MNT1/local is not held by host 1 alone"
        check [ "$(kv "$INFO_WOTHER" hosts)" = 2 ] || warn "the write file of MNT1/remote is not held by host 2 alone"
    fi
done

# What 16 KiB writes through MNT1 left in the region, read through MNT2:
# fio's verify headers (crc32c, offset) of every block, written once
# (buffered sequential to the other host, O_DIRECT random to this host).
say "5. checking 16 KiB writes through MNT2 (fio verify headers, ${VERIFY_MIB} MiB each)"
fio_verify() { # FILE_MNT1 FILE_MNT2 RW DIRECT
    local a=$1 b=$2 rw=$3 d=$4 out opts
    opts=(--name=verify --rw="$rw" --bs=16k --ioengine=psync --direct="$d" --size="${VERIFY_MIB}M"
          --numjobs=1 --fallocate=none --end_fsync=1 --randrepeat=1 --verify=crc32c
          --verify_state_save=0 --output-format=terse --terse-version=3)
    rm -f "$a"
    out=$(fio "${opts[@]}" --filename="$a" --do_verify=0 2>"$LOGS/fio.err") ||
        { cat "$LOGS/fio.err" >&2; warn "fio verify: writing $a failed"; return 1; }
    [ "$(cut -d';' -f5 <<<"$out")" = 0 ] || { warn "fio verify: writing $a: error $(cut -d';' -f5 <<<"$out")"; return 1; }
    drop_caches
    out=$(fio "${opts[@]}" --filename="$b" --verify_only=1 2>"$LOGS/fio.err") ||
        { cat "$LOGS/fio.err" >&2; warn "fio verify: $b does not read back what was written through $a"; return 1; }
    [ "$(cut -d';' -f5 <<<"$out")" = 0 ] && [ "$(cut -d';' -f6 <<<"$out")" = $((VERIFY_MIB * 1024)) ] ||
        { cat "$LOGS/fio.err" >&2; warn "fio verify: $b: error $(cut -d';' -f5 <<<"$out"), $(cut -d';' -f6 <<<"$out") KiB verified"; return 1; }
    rm -f "$a"
}
W_VSEQ=ok; W_VRAND=ok
check fio_verify "$MNT1/remote/vfy" "$MNT2/remote/vfy" write 0 || W_VSEQ=DIFFERS
check fio_verify "$MNT1/local/vfy" "$MNT2/local/vfy" randwrite 1 || W_VRAND=DIFFERS
rm -f "${WF[@]}" "$MNT1/remote/vfy" "$MNT1/local/vfy"

# ---------------------------------------------------------------- 6: sshfs reads

# The file of 1 and 2, behind sshfs (a hard link in the sshd's tmpfs).
ln "$TF" "$TMPFS/export/data"
SF_DATA=$SSHFS/data
say "6. sshfs reads of the same file: sequential 1 MiB (one pass, at most ${SEQ_CAP} s) and random 16 KiB (one pass, at most ${RAND_SECS} s), cold"
drop_caches
r=$(fio_read "$SF_DATA" read 1M "o$SEQ_CAP"); R[seq_cold_s]=${r% *}
drop_caches
r=$(fio_read "$SF_DATA" randread 16k "o$RAND_SECS"); R[rand_cold_s]=${r% *}; R[rand_cold_s_iops]=${r#* }
say "   sshfs: seq $(gbs "${R[seq_cold_s]}"), random $(mbs "${R[rand_cold_s]}" "${R[rand_cold_s_iops]}")"
rm -f "$TMPFS/export/data"

# ---------------------------------------------------------------- 7: small files

# mgr_snapshot: a file of the manager's namespace and region request counts so far, one
# "method count" line each (from its metrics page; not the mounts' CheckHandles, a liveness
# question the manager does not count as a file request either); mgr_count FILE sums one;
# mgr_ops A B says which requests came between snapshots A and B ("lookup 2, create_open 1").
mgr_snapshot() {
    local f
    f=$(mktemp "$WORK/manager-requests.XXXXXX")
    curl -fsS --max-time 5 "http://$MGR_METRICS/metrics" 2>/dev/null |
        awk '/^regions_manager_grpc_requests_total[{]/ && /service="(Namespace|Regions)"/ {
                 if (match($0, /method="[^"]*"/)) m = substr($0, RSTART + 8, RLENGTH - 9)
                 if (m != "CheckHandles") print m, $NF
             }' >"$f" || true
    [ -s "$f" ] || warn "no request counts on the manager's metrics page (http://$MGR_METRICS/metrics): the manager request counts below are wrong"
    echo "$f"
}
mgr_count() { awk '{ s += $2 } END { print s + 0 }' "$1"; }
mgr_ops() {
    awk 'FILENAME == ARGV[1] { a[$1] = $2; next } { d = $2 - a[$1]; if (d > 0) print d, $1 }' "$1" "$2" | sort -rn |
        sed -E 's/([a-z])([A-Z])/\1_\2/g' | tr 'A-Z' 'a-z' |
        awk '{ printf "%s%s %s", (NR > 1 ? ", " : ""), $2, $1 }' || true
}

say "7. small files: $SMALL_N files of $SMALL_SIZE bytes, one process per phase: MNT1 (default placement), tmpfs, sshfs"
# small_run NAME DIR: create (after drop_caches), read, cold read (after
# drop_caches), unlink; one process each. For regions, the manager's requests of each phase.
SMALL_MGR=""
small_run() {
    local name=$1 dir=$2 out ph key m0 m1
    mkdir "$dir" || fail "mkdir $dir"
    for ph in create read coldread unlink; do
        case $ph in create|coldread) drop_caches ;; esac
        m0=$(mgr_snapshot)
        out=$("$SF" "$dir" "$SMALL_N" "$SMALL_SIZE" "${ph#cold}") || fail "small_files ${ph#cold} in $dir"
        m1=$(mgr_snapshot)
        key=${ph#cold}_per_s
        R[sf_${ph}_$name]=$(kv "$out" "$key")
        if [ "$name" = regions ]; then
            SMALL_MGR+="${SMALL_MGR:+; }$ph $(awk -v n=$(($(mgr_count "$m1") - $(mgr_count "$m0"))) -v f="$SMALL_N" 'BEGIN { printf "%.2f", n / f }') per file ($(mgr_ops "$m0" "$m1"))"
            if [ "$ph" = create ]; then
                INFO_SMALL=$("$MF" info "$dir/f0" 2>&1 || true)
                say "   small file on MNT1: hosts=$(hosts_of "$dir/f0"); RINFO $INFO_SMALL"
                check [ "$(kv "$INFO_SMALL" hosts)" = 1 ] || warn "the small files on MNT1 are not held by host 1 (the creating host)"
            fi
        fi
    done
    rmdir "$dir" || fail "rmdir $dir (not empty after the unlink phase?)"
    say "   $name: create $(per_s "${R[sf_create_$name]}"), read $(per_s "${R[sf_read_$name]}"), cold read $(per_s "${R[sf_coldread_$name]}"), unlink $(per_s "${R[sf_unlink_$name]}")"
}
small_run regions "$MNT1/small"
small_run floor "$FLOOR/small"
say "   manager requests, regions: $SMALL_MGR"
small_run tmpfs "$TMPFS/small"
small_run sshfs "$SSHFS/small"

# ---------------------------------------------------------------- 8: manager requests

say "8. manager requests: ${MGR_MIB} MiB written sequentially (dd bs=1M conv=fsync) into a new file through MNT1"
mkdir "$MNT1/seq"
sleep 1
idle0=$(mgr_snapshot)
sleep 1
before=$(mgr_snapshot)
R[mgr_idle]=$(($(mgr_count "$before") - $(mgr_count "$idle0")))
# Source: the file of the run, as many times as it takes (a pipe: dd
# reads whole 1 MiB blocks with iflag=fullblock, so it writes 1 MiB each).
MGR_REPS=$(( (MGR_MIB + SIZE_MIB - 1) / SIZE_MIB ))
# (cat stops on SIGPIPE when dd has its 1 GiB: not an error.)
for ((i = 0; i < MGR_REPS; i++)); do cat "$TF" 2>/dev/null || true; done |
    dd of="$MNT1/seq/data" bs=1M count="$MGR_MIB" iflag=fullblock conv=fsync status=none || fail "dd into $MNT1/seq/data"
sleep 1
after=$(mgr_snapshot)
R[mgr_requests]=$(($(mgr_count "$after") - $(mgr_count "$before")))
MGR_OPS=$(mgr_ops "$before" "$after")
if [ "$(mgr_count "$after")" = 0 ]; then
    warn "no request counts on the manager's metrics page (http://$MGR_METRICS/metrics); no count"
    R[mgr_per_gib]=""
    CHECKS_FAILED=$((CHECKS_FAILED + 1))
else
    R[mgr_per_gib]=$(awk -v n="${R[mgr_requests]}" -v m="$MGR_MIB" 'BEGIN { printf "%.1f", n * 1024 / m }')
fi
[ "${R[mgr_idle]}" = 0 ] || warn "${R[mgr_idle]} manager requests in 1 s with nothing running: the count may include background requests"
say "   ${R[mgr_requests]} requests for ${MGR_MIB} MiB (${R[mgr_per_gib]:-?} per GiB): ${MGR_OPS:-none}"
W_MGR=ok
mgr_sz=$(stat -c %s "$MNT2/seq/data" 2>&1) || true
if [ "$mgr_sz" != $((MGR_MIB * MiB)) ]; then
    warn "$MNT2/seq/data: size $mgr_sz, $((MGR_MIB * MiB)) bytes were written through MNT1"
    W_MGR=DIFFERS
    CHECKS_FAILED=$((CHECKS_FAILED + 1))
else
    for ((i = 0; i < MGR_REPS; i++)); do
        n=$(( MGR_MIB * MiB - i * SIZE ))
        [ "$n" -le "$SIZE" ] || n=$SIZE
        if ! cmp -i "$((i * SIZE)):0" -n "$n" "$MNT2/seq/data" "$TF" >"$LOGS/cmp.out" 2>&1; then
            warn "$MNT2/seq/data differs from what was written (copy $i of the run's file): $(cat "$LOGS/cmp.out")"
            W_MGR=DIFFERS
            CHECKS_FAILED=$((CHECKS_FAILED + 1))
            break
        fi
    done
fi
rm -rf "$MNT1/seq"

# ---------------------------------------------------------------- checks

say "checking what reads back"
MMAP_SUMS=equal
for k in mr_seq mr_rand mw_seq mw_rand; do
    a=$(kv "${R[${k}_r]}" sum)
    b=$(kv "${R[${k}_t]}" sum)
    check [ -n "$a" ] && check [ "$a" = "$b" ] ||
        { warn "mmap $k: checksum through regions ($a) differs from tmpfs ($b)"; MMAP_SUMS=DIFFER; }
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

# Two tables: ROWS (regions against tmpfs) and SROWS (against sshfs); row
# adds to the one named by TABLE.
ROWS=()
SROWS=()
TABLE=ROWS
row() { local -n t_=$TABLE; t_+=("$1|$2|$3|$4|$5|$6"); }
# met_abs V MIN / met_max V MAX: "yes"/"NO" for V >= MIN / V <= MAX.
met_abs() { awk -v v="$1" -v m="$2" 'BEGIN { print (v != "" && v + 0 >= m) ? "yes" : "NO" }'; }
met_max() { awk -v v="$1" -v m="$2" 'BEGIN { print (v != "" && v + 0 <= m) ? "yes" : "NO" }'; }
thr_row() { # name regions baseline target(min ratio or "") gb|mb [regions_iops baseline_iops]
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
# 5: 16 KiB writes; targets: this host >= 0.5x tmpfs; other host: buffered
# >= 0.5x tmpfs, O_DIRECT sequential >= 0.8x the bare TCP stream.
for t in this other; do
    for test in "${WTESTS[@]}"; do
        min=0.5
        [ "$t" = other ] && case $test in seqdir|randdir) min="" ;; esac
        thr_row "write 16 KiB, $t host: ${WNAME[$test]}" "${R[w_${test}_$t]}" "${R[w_${test}_tmpfs]}" "$min" mb \
            "${R[w_${test}_${t}_iops]}" "${R[w_${test}_tmpfs_iops]}"
    done
done
row "  other host seq O_DIRECT / bare TCP" "" "" "$(ratio "${R[w_seqdir_other]}" "${R[tcp_stream]}")" ">= 0.8x" \
    "$(met "${R[w_seqdir_other]}" "${R[tcp_stream]}" 0.8)"
# 7: small files, absolute targets.
sf_row() { # name key min_per_s
    if [ -n "$3" ]; then
        row "$1" "$(per_s "${R[sf_${2}_regions]}")" "$(per_s "${R[sf_${2}_tmpfs]}")" \
            "$(ratio "${R[sf_${2}_regions]}" "${R[sf_${2}_tmpfs]}")" ">= $3/s" "$(met_abs "${R[sf_${2}_regions]}" "$3")"
    else
        row "$1" "$(per_s "${R[sf_${2}_regions]}")" "$(per_s "${R[sf_${2}_tmpfs]}")" \
            "$(ratio "${R[sf_${2}_regions]}" "${R[sf_${2}_tmpfs]}")" "-" info
    fi
}
sf_row "small files: create+write+close" create 5000
sf_row "small files: open+read+close" read 10000
sf_row "small files: open+read+close, cold" coldread ""
sf_row "small files: unlink" unlink 5000
# 8: manager requests.
row "manager requests per GiB written seq. (new region)" "${R[mgr_per_gib]:-?}" "-" "-" "<= 64" \
    "$( [ -n "${R[mgr_per_gib]}" ] && met_max "${R[mgr_per_gib]}" 64 || echo "?")"

# Against sshfs: reads of 1 and 2 (cold), writes of 5, small files of 7.
TABLE=SROWS
thr_row "seq read 1 MiB, other host, cold" "${R[seq_cold_r]}" "${R[seq_cold_s]}" "" gb
thr_row "rand read 16 KiB, other host, cold" "${R[rand_cold_r]}" "${R[rand_cold_s]}" "" mb "${R[rand_cold_r_iops]}" "${R[rand_cold_s_iops]}"
for t in other this; do
    for test in "${WTESTS[@]}"; do
        min=""
        [ "$t" = other ] && min=5
        thr_row "write 16 KiB, $t host: ${WNAME[$test]}" "${R[w_${test}_$t]}" "${R[w_${test}_sshfs]}" "$min" mb \
            "${R[w_${test}_${t}_iops]}" "${R[w_${test}_sshfs_iops]}"
    done
done
for k in create read coldread unlink; do
    case $k in
        create) n="small files: create+write+close" ;; read) n="small files: open+read+close" ;;
        coldread) n="small files: open+read+close, cold" ;; unlink) n="small files: unlink" ;;
    esac
    if [ "$k" = coldread ]; then
        row "$n" "$(per_s "${R[sf_${k}_regions]}")" "$(per_s "${R[sf_${k}_sshfs]}")" \
            "$(ratio "${R[sf_${k}_regions]}" "${R[sf_${k}_sshfs]}")" "-" info
    else
        row "$n" "$(per_s "${R[sf_${k}_regions]}")" "$(per_s "${R[sf_${k}_sshfs]}")" \
            "$(ratio "${R[sf_${k}_regions]}" "${R[sf_${k}_sshfs]}")" ">= 5x" "$(met "${R[sf_${k}_regions]}" "${R[sf_${k}_sshfs]}" 5)"
    fi
done

# Against the FUSE floor: the same measurements; a target of the tmpfs table that the floor
# itself does not reach is met within 10% of the floor.
TABLE=FROWS
FROWS=()
floor_row() { # name regions floor baseline min(or "") baseline_name|/s gb|mb|per_s [regions_iops floor_iops]
    local name=$1 r=$2 f=$3 t=$4 min=$5 base=$6 fmt=$7 ri=${8:-0} fl_i=${9:-0} vr vf target met_
    case $fmt in
        gb) vr=$(gbs "$r"); vf=$(gbs "$f") ;;
        mb) vr=$(mbs "$r" "$ri"); vf=$(mbs "$f" "$fl_i") ;;
        *) vr=$(per_s "$r"); vf=$(per_s "$f") ;;
    esac
    if [ -z "$min" ]; then
        row "$name" "$vr" "$vf" "$(ratio "$r" "$f")" "-" info
        return
    fi
    if [ "$base" = /s ]; then
        target=">= ${min}/s or 0.9x floor"
        met_=$(awk -v r="$r" -v f="$f" -v m="$min" 'BEGIN { print (r >= m || (f > 0 && f < m && r / f >= 0.9)) ? "yes" : "NO" }')
    else
        target=">= ${min}x $base or 0.9x floor"
        met_=$(awk -v r="$r" -v f="$f" -v t="$t" -v m="$min" 'BEGIN { print ((t > 0 && r / t >= m) || (f > 0 && t > 0 && f / t < m && r / f >= 0.9)) ? "yes" : "NO" }')
    fi
    row "$name" "$vr" "$vf" "$(ratio "$r" "$f")" "$target" "$met_"
}
floor_row "seq read 1 MiB, remote, cold" "${R[seq_cold_r]}" "${R[seq_cold_f]}" "${R[tcp_stream]}" 0.85 TCP gb
floor_row "seq read 1 MiB, local region" "${R[seq_local_r]}" "${R[seq_local_f]}" "${R[seq_local_t]}" 0.9 tmpfs gb
floor_row "rand read 16 KiB, remote, cold" "${R[rand_cold_r]}" "${R[rand_cold_f]}" "${R[rand_cold_t]}" 0.5 tmpfs mb "${R[rand_cold_r_iops]}" "${R[rand_cold_f_iops]}"
floor_row "rand read 16 KiB, remote, warm" "${R[rand_warm_r]}" "${R[rand_warm_f]}" "${R[rand_warm_t]}" "" "" mb "${R[rand_warm_r_iops]}" "${R[rand_warm_f_iops]}"
floor_row "rand read 16 KiB, local region" "${R[rand_local_r]}" "${R[rand_local_f]}" "${R[rand_local_t]}" 0.9 tmpfs mb "${R[rand_local_r_iops]}" "${R[rand_local_f_iops]}"
a=$(kv "${R[mr_rand_r]}" p50_us); b=$(kv "${R[mr_rand_f]}" p50_us)
row "mmap read fault, random p50 (remote)" "$(us "$a")" "$(us "$b")" "$(ratio "$a" "$b")" \
    "<= 1.3x (floor + $(us "${R[tcp_rtt]}") TCP)" \
    "$(awk -v a="$a" -v b="$b" -v t="${R[tcp_rtt]}" 'BEGIN { print (a != "" && b != "" && a <= 1.3 * (b + t)) ? "yes" : "NO" }')"
for t in this other; do
    for test in "${WTESTS[@]}"; do
        min=0.5 base=tmpfs bt=${R[w_${test}_tmpfs]}
        if [ "$t" = other ]; then
            case $test in
                seqdir) min=0.8 base=TCP bt=${R[tcp_stream]} ;;
                randdir) min="" ;;
            esac
        fi
        floor_row "write 16 KiB, $t host: ${WNAME[$test]}" "${R[w_${test}_$t]}" "${R[w_${test}_floor]}" "$bt" "$min" "$base" mb \
            "${R[w_${test}_${t}_iops]}" "${R[w_${test}_floor_iops]}"
    done
done
floor_row "small files: create+write+close" "${R[sf_create_regions]}" "${R[sf_create_floor]}" "" 5000 /s per_s
floor_row "small files: open+read+close" "${R[sf_read_regions]}" "${R[sf_read_floor]}" "" 10000 /s per_s
floor_row "small files: unlink" "${R[sf_unlink_regions]}" "${R[sf_unlink_floor]}" "" 5000 /s per_s

# print_table BASELINE_NAME ARRAY
print_table() {
    local base=$1 line a b c d e f
    local -n rows_=$2
    local w1=11 w2=7 w3=7 w4=5 w5=6
    for line in "${rows_[@]}"; do
        IFS='|' read -r a b c d e f <<<"$line"
        [ ${#a} -gt $w1 ] && w1=${#a}
        [ ${#b} -gt $w2 ] && w2=${#b}
        [ ${#c} -gt $w3 ] && w3=${#c}
        [ ${#d} -gt $w4 ] && w4=${#d}
        [ ${#e} -gt $w5 ] && w5=${#e}
    done
    printf "%-${w1}s | %${w2}s | %${w3}s | %${w4}s | %-${w5}s | %s\n" measurement regions "$base" ratio target "met?"
    printf '%s\n' "$(printf '%*s' $((w1 + w2 + w3 + w4 + w5 + 22)) '' | tr ' ' -)"
    for line in "${rows_[@]}"; do
        IFS='|' read -r a b c d e f <<<"$line"
        printf "%-${w1}s | %${w2}s | %${w3}s | %${w4}s | %-${w5}s | %s\n" "$a" "$b" "$c" "$d" "$e" "$f"
    done
}

echo
echo "regionfs benchmark: file ${SIZE_MIB} MiB, mmap file ${MMAP_MIB} MiB, random runs ${RAND_SECS} s, warm = median of ${WARM_REPS}"
echo "MNT1 (host 1) --cache $CACHE1; remote file on host 2's daemon, local region on host 1's; tcp transport on loopback"
echo "load before: $LOAD_BEFORE   after: $LOAD_AFTER   ($(nproc) cpus, $(uname -r)); ${SECONDS} s so far"
if awk -v l="${LOAD_BEFORE%% *}" -v n="$(nproc)" 'BEGIN { exit !(l > 0.5 * n) }'; then
    echo "NOTE: the machine was busy before the run (load ${LOAD_BEFORE%% *} on $(nproc) cpus): expect noisy numbers"
fi
echo "page cache of the remote file on host 1: ${R[res_cold]}% before the cold run, ${R[res_warm]}% after it; ${R[res_rand]}% after the cold random run"
print_table tmpfs ROWS
echo
print_table sshfs SROWS
echo
print_table "FUSE floor" FROWS
echo
echo "ratio = regions / tmpfs or sshfs (for latencies lower is better). tmpfs 'cold' is warm: its pages never leave memory."
echo "cold random: one pass at most (no block read twice), so every read misses the page cache unless readahead brought it in."
echo "mmap in order: default readahead and fault-around, so most touches do not fault (p50); p99 and mean carry the faults."
echo "mmap random: MADV_RANDOM, one fault per page; writes end with msync (regions ${R[mw_seq_r]##*msync_ms=} ms in order, ${R[mw_rand_r]##*msync_ms=} ms random)."
echo "writes: 16 KiB psync, one job, each run ends with an fsync inside its time; create = new file, extending writes (fio create_on_open, fsync_on_close);"
echo "  seq runs one pass over ${SIZE_MIB} MiB (at most ${SEQ_CAP} s), random runs ${RAND_SECS} s, one run each; drop_caches before each; this host = hostalloc=1, other host = hostalloc=2, both through MNT1."
echo "FUSE floor: regions-fuse-floor (tests/src/bin/fuse_floor.rs), every file a memfd answered at once, regionfs's kernel settings; each run right after its regions and tmpfs runs; 'met' when the tmpfs target is met, or when the floor itself is under it and regions is within 10% of the floor."
echo "sshfs: root@127.0.0.1 over loopback (sshd of the run, default ciphers), of a directory of the same tmpfs; reads are of the same file as 1 and 2, cold."
echo "small files: $SMALL_N files of $SMALL_SIZE bytes (benches/small_files.c), one process per phase, drop_caches before create and cold read, default placement on MNT1; 'open+read+close' right after the create, 'cold' after drop_caches."
echo "  manager requests of the small-file phases on MNT1: $SMALL_MGR"
echo "manager requests: ${R[mgr_requests]:-?} for ${MGR_MIB} MiB (dd bs=1M conv=fsync into a new file through MNT1; ${R[mgr_idle]:-?} in 1 s idle before): ${MGR_OPS:-?}"
echo "checks: cold 1 MiB samples through MNT1 ${samples_ok}/${CMP_SAMPLES} equal; whole remote file via MNT2 $W_REMOTE; local region via MNT2 $W_LOCAL; mmap writes via MNT2 $W_MMAP; mmap checksums $MMAP_SUMS;"
echo "  16 KiB writes read back via MNT2 (fio verify): buffered seq to the other host $W_VSEQ, O_DIRECT random to this host $W_VRAND; small files' contents checked; manager step's file via MNT2 $W_MGR"

# Results that cannot be right.
sane=1
for k in seq_cold_r seq_warm_r seq_local_r rand_cold_r rand_warm_r rand_local_r seq_cold_s rand_cold_s \
         $(for t in "${WTARGETS[@]}"; do for x in "${WTESTS[@]}"; do echo "w_${x}_$t"; done; done); do
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
