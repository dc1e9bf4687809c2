#!/usr/bin/env bash
# Runs one demo on a throw-away cluster on loopback (README.md, "Demos"):
#
#   examples/run-demo.sh shell     [--small]   paper Fig. 1 with shell tools, 2 hosts
#   examples/run-demo.sh r         [--small]   R + ff: R-Agg and R-LR on regions vs tmpfs, 2 hosts
#   examples/run-demo.sh mapreduce [--small]   distributed histogram vs one process, 3 hosts
#
# It starts a regions-manager, one regions-daemon per host id and one
# `regionfs mount` per host id (all on 127.0.0.1, state in a temp directory),
# runs the demo, which asserts its results, and stops every process it started
# by PID and removes the directory, also on failure or Ctrl-C.
#
# Binaries: $REGIONS_BIN_DIR when set (the tests set it), else target/release,
# brought up to date with `cargo build --release` first.
# `--small` (or REGIONS_DEMO_SMALL=1) runs the reduced size CI uses.
# Run as root (FUSE mounts), with /dev/fuse.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)

usage() {
  echo "usage: $0 shell|r|mapreduce [--small]" >&2
  exit 2
}

demo=${1:-}
[ -n "$demo" ] || usage
shift
small=${REGIONS_DEMO_SMALL:-0}
for arg in "$@"; do
  case $arg in
    --small) small=1 ;;
    *) usage ;;
  esac
done

case $demo in
  shell) hosts=2 bins=(regions-manager regions-daemon regionfs) ;;
  r) hosts=2 bins=(regions-manager regions-daemon regionfs) ;;
  mapreduce) hosts=3 bins=(regions-manager regions-daemon regionfs regions-mapreduce) ;;
  *) usage ;;
esac

if [ "$(id -u)" != 0 ]; then
  echo "run-demo: FUSE mounts need root; run this as root" >&2
  exit 1
fi

# --- binaries -----------------------------------------------------------
if [ -n "${REGIONS_BIN_DIR:-}" ]; then
  bindir=$REGIONS_BIN_DIR
  for b in "${bins[@]}"; do
    if [ ! -x "$bindir/$b" ]; then
      echo "run-demo: $bindir/$b is missing: build it (cargo build --bins) or unset REGIONS_BIN_DIR" >&2
      exit 1
    fi
  done
else
  # Release binaries of this work tree: cargo rebuilds what changed (a no-op
  # when they are fresh); without cargo, whatever target/release holds.
  bindir=$root/target/release
  if command -v cargo >/dev/null; then
    pkgs=()
    for b in "${bins[@]}"; do pkgs+=(-p "$b"); done
    (cd "$root" && cargo build --release --quiet --bins "${pkgs[@]}")
  fi
  for b in "${bins[@]}"; do
    if [ ! -x "$bindir/$b" ]; then
      echo "run-demo: $bindir/$b is missing: run cargo build --release --bins" >&2
      exit 1
    fi
  done
fi

# --- cluster --------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/regions-demo.XXXXXX")
logs=$work/logs
mkdir -p "$logs"
pids=()        # every process started, in start order
mount_pids=()  # the regionfs mounts among them
mounts=()      # their mount points
extra_cleanup=()

stop_pid() { # pid: SIGTERM, wait at most 10 s, then SIGKILL
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
}

cleanup() {
  local status=$? i
  set +e
  for c in "${extra_cleanup[@]}"; do eval "$c"; done
  # Mounts first (a clean unmount needs their daemons), then the others.
  for pid in "${mount_pids[@]}"; do stop_pid "$pid"; done
  for m in "${mounts[@]}"; do
    if mountpoint -q "$m" 2>/dev/null; then umount -l "$m"; fi
  done
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do stop_pid "${pids[i]}"; done
  wait 2>/dev/null
  if [ "$status" != 0 ]; then
    echo "run-demo: FAILED (exit $status); process logs:" >&2
    for f in "$logs"/*.log; do
      [ -s "$f" ] || continue
      echo "--- $(basename "$f")" >&2
      tail -n 30 "$f" >&2
    done
  fi
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

wait_ready() { # name pid ready-file: waits at most 30 s
  local name=$1 pid=$2 file=$3 i
  for ((i = 0; i < 300; i++)); do
    if [ -s "$file" ]; then return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "run-demo: $name exited before it was ready" >&2
      return 1
    fi
    sleep 0.1
  done
  echo "run-demo: $name was not ready within 30 s" >&2
  return 1
}

# memory each daemon offers, and options of the mounts: set per demo below
memory_of() { echo "${daemon_memory[$1]:-256M}"; }
declare -A daemon_memory=()
mount_args=()
case $demo in
  r)
    if [ "$small" = 1 ]; then daemon_memory[2]=1G; else daemon_memory[2]=4G; fi
    ;;
  mapreduce)
    if [ "$small" = 1 ]; then daemon_memory[1]=512M; else daemon_memory[1]=2G; fi
    # Read-only opens of a region held wholly on the mount's own host are
    # served from that host's memory (FUSE passthrough): the mapper on
    # host 1 maps host 1's copy of the input instead of copying it through
    # the page cache; the others fetch theirs through the transport.
    mount_args=(--cache passthrough)
    ;;
esac

start_cluster() { # hosts
  local n=$1 h
  # Mode 0600: the components refuse a secret others may read.
  (umask 077 && head -c 32 /dev/urandom | base64 | tr -d '/+=' >"$work/secret")
  mkdir -p "$work/manager"
  RUST_LOG=${RUST_LOG:-warn} "$bindir/regions-manager" --listen 127.0.0.1:0 \
    --data-dir "$work/manager" --secret-file "$work/secret" \
    --ready-file "$work/manager.ready" </dev/null >/dev/null 2>"$logs/manager.log" &
  pids+=($!)
  wait_ready regions-manager $! "$work/manager.ready"
  manager=http://$(cat "$work/manager.ready")
  for ((h = 1; h <= n; h++)); do
    RUST_LOG=${RUST_LOG:-warn} "$bindir/regions-daemon" --manager "$manager" --host-id "$h" \
      --listen 127.0.0.1:0 --memory "$(memory_of "$h")" --socket "$work/agent$h.sock" \
      --secret-file "$work/secret" --ready-file "$work/daemon$h.ready" \
      </dev/null >/dev/null 2>"$logs/daemon$h.log" &
    pids+=($!)
    wait_ready "regions-daemon (host $h)" $! "$work/daemon$h.ready"
  done
  for ((h = 1; h <= n; h++)); do
    mkdir -p "$work/mnt$h"
    RUST_LOG=${RUST_LOG:-warn} "$bindir/regionfs" mount --manager "$manager" --host-id "$h" \
      --secret-file "$work/secret" --agent-socket "$work/agent$h.sock" \
      --ready-file "$work/mount$h.ready" "${mount_args[@]}" "$work/mnt$h" \
      </dev/null >/dev/null 2>"$logs/mount$h.log" &
    pids+=($!)
    mount_pids+=($!)
    mounts+=("$work/mnt$h")
    wait_ready "regionfs mount (host $h)" $! "$work/mount$h.ready"
  done
  echo "run-demo: cluster up: manager $manager, $n hosts, mounts $work/mnt{1..$n}" >&2
}

start_cluster "$hosts"
export REGIONS_DEMO_WORK=$work

case $demo in
  shell)
    bash "$root/examples/shell/walkthrough.sh" "$work/mnt1" "$work/mnt2"
    ;;
  r)
    if ! command -v Rscript >/dev/null; then
      echo "run-demo: Rscript is missing: apt-get install -y r-cran-ff" >&2
      exit 1
    fi
    size_args=()
    [ "$small" = 1 ] && size_args=(--small)
    bash "$root/examples/r/run.sh" "$work/mnt1" "$work/mnt2" "${size_args[@]}"
    ;;
  mapreduce)
    size_args=()
    [ "$small" = 1 ] && size_args=(--small)
    "$bindir/regions-mapreduce" run --mounts "$work/mnt1,$work/mnt2,$work/mnt3" "${size_args[@]}"
    ;;
esac
echo "run-demo: $demo demo passed" >&2
