#!/usr/bin/env bash
# Small regions through the mount: memory after creating many small files and deleting most,
# against the ideal and against one segment per region, measured in one run.
#
#   cargo build --release --bins && bash benches/small_regions.sh
#
# Starts a single-host cluster (`regionfs up` with --small-regions 4K, in a scratch directory
# on free ports), then through its mount:
#   1. creates N files (default 40,000: the embedded daemon's 256 MiB object store holds
#      about 80,000 of them before any is deleted) of random sizes from 64 B to 4 KiB, each
#      written whole;
#   2. deletes a random 75%;
#   3. reads the object store's figures from .regions/pools (the daemon's default policy
#      compacts a class when a free leaves it more than a fifth free), runs `regionfs compact`
#      and reads them again;
#   4. reads every survivor back and checks its bytes.
# It prints the memory the object store holds (its memfd's allocated pages) beside the ideal
# (the survivors' bytes plus a 32-byte header each) and beside one segment per region (at
# least one page per region, the layout without small regions), as ratios; target after
# compaction <= 1.15x the ideal. Also the rates of create, unlink and read per second.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
REGIONFS=${REGIONFS:-$ROOT/target/release/regionfs}
N=${N:-40000}
SEED=${SEED:-7}

[ -x "$REGIONFS" ] || { echo "FAILED: $REGIONFS missing: cargo build --release --bins" >&2; exit 1; }
command -v python3 >/dev/null || { echo "FAILED: python3 is needed" >&2; exit 1; }

WORK=$(mktemp -d /tmp/regions-small-bench.XXXXXX)
MNT=$WORK/mnt
UP_PID=
cleanup() {
    if [ -n "$UP_PID" ] && kill -0 "$UP_PID" 2>/dev/null; then
        kill -INT "$UP_PID" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$UP_PID" 2>/dev/null || true
    fi
    mountpoint -q "$MNT" 2>/dev/null && umount -l "$MNT" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
MPORT=$(free_port)
TPORT=$(free_port)
"$REGIONFS" up "$MNT" --data-dir "$WORK/data" --memory 2G \
    --listen "127.0.0.1:$MPORT" --transport-listen "127.0.0.1:$TPORT" \
    --small-regions 4K >"$WORK/up.log" 2>&1 &
UP_PID=$!
for _ in $(seq 1 300); do
    mountpoint -q "$MNT" 2>/dev/null && break
    kill -0 "$UP_PID" 2>/dev/null || { cat "$WORK/up.log" >&2; echo "FAILED: regionfs up exited" >&2; exit 1; }
    sleep 0.1
done
mountpoint -q "$MNT" || { cat "$WORK/up.log" >&2; echo "FAILED: no mount after 30 s" >&2; exit 1; }

pools() { cat "$MNT/.regions/pools"; }
# The memory the store's memfd actually holds (its allocated pages), and the bytes of the
# blocks its classes hold (whole 32 KiB blocks, untouched pages included).
held() { pools | sed -n 's/^# small regions as objects on host [0-9]*: \([0-9]*\) bytes of memory held.*/\1/p'; }
blocks() { pools | awk -F'\t' '/^class_slot/ { on = 1; next } on && NF >= 5 { s += $5 } END { print s + 0 }'; }
# Objects whose pointer the manager has not corrected yet after compaction moved them.
indirect() { pools | awk -F'\t' '/^class_slot/ { on = 1; next } on && NF >= 9 { s += $9 } END { print s + 0 }'; }

python3 - "$MNT" "$N" "$SEED" "$WORK/survivors" >"$WORK/rates" <<'EOF'
import os, random, sys, time
mnt, n, seed, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = random.Random(seed)
d = os.path.join(mnt, "small")
os.mkdir(d)
sizes = [rng.randint(64, 4096) for _ in range(n)]
t = time.monotonic()
for i, size in enumerate(sizes):
    with open(os.path.join(d, str(i)), "wb") as f:
        f.write(bytes([i % 251]) * size)
create = n / (time.monotonic() - t)
doomed = rng.sample(range(n), n * 3 // 4)
t = time.monotonic()
for i in doomed:
    os.unlink(os.path.join(d, str(i)))
unlink = len(doomed) / (time.monotonic() - t)
gone = set(doomed)
with open(out, "w") as f:
    for i in range(n):
        if i not in gone:
            f.write(f"{i} {sizes[i]}\n")
print(f"create {create:.0f} unlink {unlink:.0f}")
EOF
before=$(held)
before_blocks=$(blocks)
compact_out=$("$REGIONFS" compact --manager "http://127.0.0.1:$MPORT" --secret-file "$WORK/data/secret")
after=$(held)
after_blocks=$(blocks)
# The manager corrects the pointers of moved objects about once a second, up to 1,024 a round.
indirect_after=$(indirect)
t0=$(date +%s.%N)
for _ in $(seq 1 600); do [ "$(indirect)" = 0 ] && break; sleep 0.1; done
indirect_left=$(indirect)
corrected_in=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
read_rate=$(python3 - "$MNT" "$WORK/survivors" <<'EOF'
import os, sys, time
mnt, path = sys.argv[1], sys.argv[2]
items = [tuple(map(int, l.split())) for l in open(path)]
t = time.monotonic()
for i, size in items:
    with open(os.path.join(mnt, "small", str(i)), "rb") as f:
        data = f.read()
    if data != bytes([i % 251]) * size:
        sys.exit(f"FAILED: small/{i} read back {len(data)} bytes that are not what was written ({size})")
print(f"{len(items) / (time.monotonic() - t):.0f}")
EOF
)
read ideal pages live < <(awk '{ ideal += $2 + 32; pages += int(($2 + 4095) / 4096) * 4096; n++ } END { print ideal, pages, n }' "$WORK/survivors")
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }
mb() { awk -v v="$1" 'BEGIN { printf "%.1f MB", v / 1e6 }'; }
echo "== small regions through the mount: $N files of 64 B-4 KiB, 75% deleted, $live left"
read create_rate unlink_rate < <(awk '{ print $2, $4 }' "$WORK/rates")
echo "per second: create+write+close $create_rate, unlink $unlink_rate, open+read+check $read_rate"
printf '%-44s %12s %8s\n' "memory" "bytes" "x ideal"
printf '%-44s %12s %8s\n' "ideal (survivors' bytes + 32 B headers)" "$(mb "$ideal")" "1.00x"
printf '%-44s %12s %8s\n' "object store memory, default policy" "$(mb "$before")" "$(ratio "$before" "$ideal")"
printf '%-44s %12s %8s\n' "object store memory, after regionfs compact" "$(mb "$after")" "$(ratio "$after" "$ideal")"
printf '%-44s %12s %8s\n' "  (whole blocks: default, after compact)" "$(mb "$before_blocks"), $(mb "$after_blocks")" ""
printf '%-44s %12s %8s\n' "one segment per region (whole pages)" "$(mb "$pages")" "$(ratio "$pages" "$ideal")"
echo "target: after compaction <= 1.15x ideal: $(awk -v a="$after" -v b="$ideal" 'BEGIN { print (a / b <= 1.15) ? "met" : "NOT met" }')"
echo "pointers to correct after compaction: $indirect_after; left after ${corrected_in} s: $indirect_left"
echo "regionfs compact said:"
echo "$compact_out" | sed 's/^/  /'
