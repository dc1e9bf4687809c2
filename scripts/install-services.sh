#!/bin/sh
# Installs regions as systemd services: the binaries, the units of packaging/systemd
# (regions-manager, regions-daemon, regionfs for a cluster; regions-up for one machine),
# commented config files and the cluster secret (mode 0600).
#
#   scripts/install-services.sh [options]
#
#   --bin-dir DIR     use the binaries already in DIR instead of building and copying them
#                     to /usr/local/bin (cargo build --release --bins)
#   --unit-dir DIR    where the units go (default /etc/systemd/system)
#   --config-dir DIR  where config files and the secret go (default /etc/regions);
#                     existing files are never overwritten
#
# Then, on the manager's host:   systemctl enable --now regions-manager
# on every host:                 systemctl enable --now regions-daemon regionfs
# (edit daemon.toml and regionfs.toml first: host-id, addresses, memory), or on a single
# machine:                       systemctl enable --now regions-up
# Copy the same secret file to every host of a cluster.
set -eu

usage() {
    echo "usage: $0 [--bin-dir DIR] [--unit-dir DIR] [--config-dir DIR]" >&2
    exit 2
}

bin_dir=
unit_dir=/etc/systemd/system
config_dir=/etc/regions
while [ $# -gt 0 ]; do
    case "$1" in
    --bin-dir) [ $# -ge 2 ] || usage; bin_dir=$2; shift 2 ;;
    --unit-dir) [ $# -ge 2 ] || usage; unit_dir=$2; shift 2 ;;
    --config-dir) [ $# -ge 2 ] || usage; config_dir=$2; shift 2 ;;
    -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
    *) usage ;;
    esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "$bin_dir" ]; then
    (cd "$root" && cargo build --release --bins)
    target=${CARGO_TARGET_DIR:-$root/target}
    bin_dir=/usr/local/bin
    for b in regions-manager regions-daemon regionfs; do
        install -m 0755 "$target/release/$b" "$bin_dir/$b"
    done
fi
for b in regions-manager regions-daemon regionfs; do
    if [ ! -x "$bin_dir/$b" ]; then
        echo "no executable $bin_dir/$b: build it (cargo build --release --bins) or pass --bin-dir" >&2
        exit 1
    fi
done
bin_dir=$(cd "$bin_dir" && pwd)

mkdir -p "$unit_dir" "$config_dir"
chmod 0755 "$config_dir"
for unit in "$root"/packaging/systemd/*.service; do
    sed -e "s|@BIN_DIR@|$bin_dir|g" -e "s|@CONFIG_DIR@|$config_dir|g" -e "s|@DOC_DIR@|$root|g" \
        "$unit" >"$unit_dir/$(basename "$unit")"
    chmod 0644 "$unit_dir/$(basename "$unit")"
done
for conf in "$root"/packaging/config/*.toml; do
    dest=$config_dir/$(basename "$conf")
    [ -e "$dest" ] || install -m 0644 "$conf" "$dest"
done
if [ ! -e "$config_dir/secret" ]; then
    # Created unreadable to others before any byte of the secret is written.
    (umask 077 && head -c 32 /dev/urandom | base64 >"$config_dir/secret")
fi
chmod 0600 "$config_dir/secret"

if [ "$unit_dir" = /etc/systemd/system ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi
echo "installed units in $unit_dir, settings and secret in $config_dir (binaries: $bin_dir)"
echo "one machine:  systemctl enable --now regions-up"
echo "a cluster:    systemctl enable --now regions-manager (its host); regions-daemon regionfs (every host)"
