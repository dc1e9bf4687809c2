#!/usr/bin/env bash
# The data-plane, sync and mapping benches on RDMA, in the soft-RoCE VM (this machine's
# kernel has no RDMA device; tests/src/soft_roce.rs boots Debian's kernel with rdma_rxe under
# qemu), beside the device's own floor measured in the same VM: perftest's ib_read_lat
# (4 KiB) and ib_read_bw (1 MiB) on rxe0.
#
#   benches/rdma-vm.sh                 # small runs of all three (about 5 minutes)
#   benches/rdma-vm.sh --full sync     # the full-size run of one bench
#
# Under qemu's software emulation everything is 10-50x slower than on hardware, and the
# "device" is the kernel's rxe code on the same emulated CPUs: these runs show that the
# benches work on RDMA and how regions compares with raw verbs on the same device, not how
# fast RDMA is. On real NICs run the benches with `-- --transport rdma --rdma-device NAME`
# directly, and compare with ib_read_lat / ib_read_bw between the same hosts.
set -euo pipefail
cd "$(dirname "$0")/.."

full=0
if [ "${1:-}" = "--full" ]; then
    full=1
    shift
fi
benches=("$@")
[ ${#benches[@]} -gt 0 ] || benches=(data_plane sync mapping)

cargo build --release --bins
bin_dir="$PWD/target/release"
script="export REGIONS_BIN_DIR=$bin_dir RUST_LOG=warn; failed=;"
script+=" echo '== floor: ib_read_lat, 4 KiB, rxe0 ==';"
script+=" (ib_read_lat -d rxe0 -x 0 -s 4096 -n 500 >/dev/null 2>&1 &) ; sleep 2;"
script+=" ib_read_lat -d rxe0 -x 0 -s 4096 -n 500 127.0.0.1 | grep -A1 -E 't_min|bytes';"
script+=" echo '== floor: ib_read_bw, 1 MiB, rxe0 ==';"
script+=" (ib_read_bw -d rxe0 -x 0 -s 1048576 -n 100 >/dev/null 2>&1 &) ; sleep 2;"
script+=" ib_read_bw -d rxe0 -x 0 -s 1048576 -n 100 127.0.0.1 | grep -A1 -E 'BW average|bytes';"
script+=" echo '== bounce buffer or registration of the caller buffer ==';"
script+=" $bin_dir/regions-rdma-buffers rxe0 || failed=\"\$failed buffers\";"
for b in "${benches[@]}"; do
    exe=$(cargo bench -p regions-tests --bench "$b" --no-run 2>&1 |
        sed -n "s|.*Executable benches/$b.rs (\(.*\))|\1|p" | tail -1)
    [ -n "$exe" ] || { echo "rdma-vm.sh: no bench named $b" >&2; exit 2; }
    # Without --bench each bench runs its small version.
    args="--transport rdma --rdma-device rxe0"
    [ $full = 1 ] && args="--bench $args"
    script+=" echo '== $b on RDMA ==';"
    script+=" $PWD/$exe $args || failed=\"\$failed $b\";"
done
script+=' [ -z "$failed" ] || { echo "failed:$failed"; false; }' 
exec "$bin_dir/regions-soft-roce" --timeout 3600 "$script"
