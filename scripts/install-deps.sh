#!/bin/sh
# Installs the Debian packages that building regions and running its tests
# need, on Debian 12 or later with the Rust toolchain already installed.
# README.md's quick start and .ci/run both call this script, so the two
# cannot drift apart.
#
#   scripts/install-deps.sh           install what is missing (as root)
#   scripts/install-deps.sh --list    print the package names, one per line
#
# What each package is for:
#   ca-certificates
#                  cargo fetches crates over https
#   fuse3          /dev/fuse tools (fusermount3) for the mount
#   libclang-dev   bindgen, which builds the userfaultfd bindings
#   gcc make pkg-config
#                  C parts of dependencies; the C examples and the C ABI tests
#   attr           getfattr/setfattr (region attributes are xattrs)
#   iproute2       network namespaces for the address-level tests
#   python3 python3-numpy
#                  the POSIX conformance suite, numpy.memmap and ctypes examples
#   r-cran-ff      the R demo (paper section 8.6)
#   systemd        systemd-analyze, which checks the service files of packaging/systemd
#   libibverbs-dev cmake libnl-3-dev libnl-route-3-dev
#                  the RDMA transport: libibverbs, and what its bindings are built with
#   ibverbs-providers
#                  the user-space drivers of RDMA devices (soft-RoCE's among them)
#   qemu-system-x86 linux-image-amd64 busybox-static
#                  the RDMA tests: they boot Debian's kernel, which has soft-RoCE
#                  (rdma_rxe), in a VM with virtme-ng (from PyPI: `pip install virtme-ng`,
#                  which this script runs too)
#   perftest       ib_read_lat / ib_read_bw: the device's own floor beside the benches
#                  that benches/rdma-vm.sh runs in that VM
set -eu

packages="ca-certificates fuse3 libclang-dev gcc make pkg-config attr iproute2 python3 python3-numpy r-cran-ff systemd libibverbs-dev cmake libnl-3-dev libnl-route-3-dev ibverbs-providers qemu-system-x86 linux-image-amd64 busybox-static perftest"

# virtme-ng (PyPI), which boots the RDMA tests' VM; after the Debian packages.
install_virtme_ng() {
    if command -v vng >/dev/null 2>&1 || python3 -c 'import virtme_ng' 2>/dev/null; then
        return 0
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "missing virtme-ng; run this script as root (sudo $0)" >&2
        exit 1
    fi
    python3 -m pip install --quiet virtme-ng
}

case "${1:-}" in
--list)
    for p in $packages; do echo "$p"; done
    exit 0
    ;;
"") ;;
-h | --help)
    sed -n '2,20p' "$0"
    exit 0
    ;;
*)
    echo "usage: $0 [--list]" >&2
    exit 2
    ;;
esac

missing=
for p in $packages; do
    dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -z "$missing" ]; then
    install_virtme_ng
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "missing Debian packages:$missing; run this script as root (sudo $0)" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "missing packages:$missing; this script needs apt-get (Debian or Ubuntu); install them with your package manager" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086 # one word per package
apt-get install -y -qq --no-install-recommends $missing
install_virtme_ng
