#!/usr/bin/env python3
"""numpy.memmap on a region: a region is a file, so numpy maps it like any
other (no libregions needed, only a regions mount).

    numpy_memmap.py [PATH] [--rows N] [--check]

PATH is a file under a regions mount (default /regions/numpy_memmap.f64).
Without --check it creates the region as an N x 1024 float64 array (default
N = 256, 2 MiB), fills it with x[i, j] = i * 1024 + j through the mapping,
flushes (msync) and closes it, then maps it again read-only and checks every
element. With --check it only maps and checks an existing array, e.g. on
another host.

Consistency is close-to-open, as on NFS: the stores land in the region's
memory when the mapping is flushed (memmap.flush(), i.e. msync) or unmapped,
and the new size reaches the cluster at close, fsync or msync. A process on
another host that opens the file after that sees every byte.
"""

import argparse
import sys

import numpy as np

COLS = 1024


def expected(rows):
    return np.arange(rows * COLS, dtype=np.float64).reshape(rows, COLS)


def write(path, rows):
    # mode "w+" creates (or truncates) the file and sizes it to the array.
    a = np.memmap(path, dtype=np.float64, mode="w+", shape=(rows, COLS))
    a[:] = expected(rows)
    a.flush()  # msync: the bytes are in the region now
    del a  # unmaps
    print(f"wrote {rows}x{COLS} float64 ({rows * COLS * 8} bytes) to {path}")


def check(path, rows):
    # mode "r" maps read-only; the shape comes from the file's size.
    b = np.memmap(path, dtype=np.float64, mode="r")
    if b.size != rows * COLS:
        sys.exit(f"numpy_memmap: {path} holds {b.size} float64, expected {rows * COLS}")
    b = b.reshape(rows, COLS)
    bad = np.argwhere(b != expected(rows))
    if len(bad):
        i, j = bad[0]
        sys.exit(f"numpy_memmap: {path}[{i}, {j}] is {b[i, j]}, expected {i * COLS + j} "
                 f"({len(bad)} elements differ)")
    print(f"checked {rows}x{COLS} float64 in {path}: all equal, sum {b.sum():.0f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", nargs="?", default="/regions/numpy_memmap.f64")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--check", action="store_true", help="only check an existing array")
    args = p.parse_args()
    if args.rows <= 0:
        sys.exit("numpy_memmap: --rows must be positive")
    try:
        if not args.check:
            write(args.path, args.rows)
        check(args.path, args.rows)
    except OSError as e:
        sys.exit(f"numpy_memmap: {e} (is a regions mount there?)")


if __name__ == "__main__":
    main()
