#!/bin/sh
# Installs the libregions C library: libregions.so, libregions.a, regions.h
# and the pkg-config file regions.pc.
#
#   scripts/install-libregions.sh [--lib-dir DIR] PREFIX
#
# Without --lib-dir it builds the library first (cargo build --release -p
# libregions) and installs target/release/libregions.{so,a}. With --lib-dir it
# installs the libraries found in DIR without building (the tests use the
# debug build in target/debug/deps).
#
# Files land in PREFIX/lib, PREFIX/include and PREFIX/lib/pkgconfig. Then:
#
#   export PKG_CONFIG_PATH=PREFIX/lib/pkgconfig    (unless PREFIX is /usr or /usr/local)
#   cc prog.c $(pkg-config --cflags --libs regions)
#   LD_LIBRARY_PATH=PREFIX/lib ./a.out             (or run ldconfig for PREFIX/lib)
set -eu

usage() {
    echo "usage: $0 [--lib-dir DIR] PREFIX" >&2
    exit 2
}

lib_dir=
while [ $# -gt 0 ]; do
    case "$1" in
    --lib-dir) [ $# -ge 2 ] || usage; lib_dir=$2; shift 2 ;;
    -h | --help) sed -n '2,18p' "$0"; exit 0 ;;
    -*) usage ;;
    *) break ;;
    esac
done
[ $# -eq 1 ] || usage
prefix=$1

root=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "$lib_dir" ]; then
    (cd "$root" && cargo build --release -p regions)
    target=${CARGO_TARGET_DIR:-$root/target}
    lib_dir=$target/release
fi
for f in libregions.so libregions.a; do
    if [ ! -f "$lib_dir/$f" ]; then
        echo "$0: $lib_dir/$f is missing; build it with: cargo build --release -p regions" >&2
        exit 1
    fi
done

version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -n 1)
# Native libraries a program linking libregions.a statically also needs
# (rustc --print native-static-libs on Linux; libibverbs for the RDMA
# transport, feature rdma, on by default).
private_libs="-libverbs -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc"

mkdir -p "$prefix/lib/pkgconfig" "$prefix/include"
prefix=$(cd "$prefix" && pwd)
install -m 0755 "$lib_dir/libregions.so" "$prefix/lib/libregions.so"
install -m 0644 "$lib_dir/libregions.a" "$prefix/lib/libregions.a"
install -m 0644 "$root/libregions/include/regions.h" "$prefix/include/regions.h"
sed -e "s|@PREFIX@|$prefix|" \
    -e "s|@LIBDIR@|$prefix/lib|" \
    -e "s|@INCLUDEDIR@|$prefix/include|" \
    -e "s|@VERSION@|$version|" \
    -e "s|@PRIVATE_LIBS@|$private_libs|" \
    "$root/libregions/regions.pc.in" > "$prefix/lib/pkgconfig/regions.pc"
chmod 0644 "$prefix/lib/pkgconfig/regions.pc"
if [ "$(id -u)" = 0 ] && { [ "$prefix" = /usr/local ] || [ "$prefix" = /usr ]; }; then
    ldconfig 2>/dev/null || true
fi
echo "installed libregions $version under $prefix"
