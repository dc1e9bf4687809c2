#!/usr/bin/env python3
"""Cache control of a mapped region from Python, through libregions' C ABI
(ctypes): rmap, rprefetch, rclearcache, rmsync (Remote Regions paper §5.8-5.10).

    cache_control.py REGION_PATH [--write]

Maps the region (at its fixed address if it is FIXVADDR), prefetches it
synchronously, reads it, drops this host's cached copy with rclearcache and
reads it again (fetching afresh, so a writer's newer data shows), printing the
time of each step. With --write it first writes a pattern into the first page
and rmsyncs it.

The library is found through $REGIONS_LIB, else ctypes.util.find_library
("regions"), e.g. after scripts/install-libregions.sh /usr/local. The mount is
that of the file; $REGIONS_MOUNT (default /regions) matters only for calls
without a descriptor.
"""

import ctypes
import ctypes.util
import os
import sys
import time

MS_SYNC = 4


def load():
    path = os.environ.get("REGIONS_LIB") or ctypes.util.find_library("regions")
    if not path:
        sys.exit("cache_control: libregions not found: install it "
                 "(scripts/install-libregions.sh PREFIX) or set REGIONS_LIB")
    lib = ctypes.CDLL(path, use_errno=True)
    lib.rmap.argtypes = [ctypes.c_int]
    lib.rmap.restype = ctypes.c_void_p
    lib.runmap.argtypes = [ctypes.c_void_p]
    lib.runmap.restype = ctypes.c_int
    lib.rprefetch.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_bool]
    lib.rprefetch.restype = ctypes.c_int
    lib.rclearcache.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.rclearcache.restype = ctypes.c_int
    lib.rmsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.rmsync.restype = ctypes.c_int
    return lib


def check(what, ret):
    if ret == -1 or ret is None:
        err = ctypes.get_errno()
        sys.exit(f"cache_control: {what}: {os.strerror(err)}")
    return ret


def timed(label, fn):
    t = time.perf_counter()
    out = fn()
    print(f"{label:<28} {(time.perf_counter() - t) * 1e3:8.2f} ms")
    return out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        sys.exit(__doc__)
    write = "--write" in sys.argv
    lib = load()
    fd = os.open(args[0], os.O_RDWR if write else os.O_RDONLY)
    size = os.fstat(fd).st_size
    if size == 0:
        sys.exit("cache_control: the region is empty")
    base = check("rmap", lib.rmap(fd))
    print(f"mapped {size} bytes at {base:#x}")
    if write:
        pattern = (b"written by cache_control " * 200)[:min(size, 4096)]
        ctypes.memmove(base, pattern, len(pattern))
        check("rmsync", lib.rmsync(base, len(pattern), MS_SYNC))
    timed("rprefetch (sync)", lambda: check("rprefetch", lib.rprefetch(base, size, True)))
    first = timed("read (cached)", lambda: ctypes.string_at(base, size))
    timed("rclearcache", lambda: check("rclearcache", lib.rclearcache(base, size)))
    second = timed("read (fetched again)", lambda: ctypes.string_at(base, size))
    print(f"first bytes: {second[:32]!r}")
    print("unchanged since the first read" if first == second
          else "changed since the first read (another host wrote)")
    check("runmap", lib.runmap(base))
    os.close(fd)


if __name__ == "__main__":
    main()
