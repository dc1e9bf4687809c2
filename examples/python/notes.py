#!/usr/bin/env python3
"""A list of text notes kept in a region with rmalloc, through the ctypes
binding in regions_ctypes.py (copy both files).

    notes.py REGION_PATH add TEXT...   append notes (creates the region)
    notes.py REGION_PATH list          print the notes, one per line
    notes.py REGION_PATH clear         rfree every note

The region is created FIXVADDR and PERSISTENT (rsetdefaultattr before the
open), so it maps at the same address on every host and the pointers stored
in it (the root, each note's `next`) are valid everywhere; it outlives this
program. Run `add` on one host and `list` on another: the second host maps the
region and chases the pointers, fetching pages on first touch. Writers take
the cluster-wide mutex "notes:<name>" (rmutex_lock), so adds from several
hosts do not interleave; each unmaps (writing back) before it unlocks.

Needs libregions ($REGIONS_LIB or the system library path) and a regions mount
with its host agent ($REGIONS_MOUNT, default /regions: the mutex and the
default attributes go through it).
"""

import ctypes
import os
import sys

import regions_ctypes as rc

MAGIC = 0x4E4F544553303031  # "NOTES001"


class Head(ctypes.Structure):
    _fields_ = [
        ("magic", ctypes.c_uint64),
        ("count", ctypes.c_uint64),
        ("first", ctypes.c_uint64),  # address of the first Node, 0 if none
        ("last", ctypes.c_uint64),
    ]


class Node(ctypes.Structure):
    _fields_ = [
        ("next", ctypes.c_uint64),
        ("len", ctypes.c_uint64),  # bytes of text right after the Node
    ]


def die(msg):
    sys.exit(f"notes: {msg}")


def head_of(lib, fd, create):
    root = lib.rgetroot(fd)
    if root is None:
        if not create:
            return None
        root = lib.rmalloc(fd, ctypes.sizeof(Head))
        head = Head.from_address(root)
        head.magic, head.count, head.first, head.last = MAGIC, 0, 0, 0
        lib.rsetroot(fd, root)
        return head
    head = Head.from_address(root)
    if head.magic != MAGIC:
        die(f"the region's root is not a notes list (magic {head.magic:#x})")
    return head


def nodes(head):
    at = head.first
    while at:
        node = Node.from_address(at)
        yield at, node, ctypes.string_at(at + ctypes.sizeof(Node), node.len)
        at = node.next


def open_fixvaddr(lib, path):
    # Regions this thread creates from now on are FIXVADDR and PERSISTENT;
    # an existing region keeps its attributes.
    lib.rsetdefaultattr(rc.RATTR_FIXVADDR, "1")
    lib.rsetdefaultattr(rc.RATTR_PERSISTENT, "1")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    finally:
        lib.rsetdefaultattr(rc.RATTR_FIXVADDR, None)
        lib.rsetdefaultattr(rc.RATTR_PERSISTENT, None)
    if os.getxattr(fd, "user.regions.fixvaddr") != b"1":
        os.close(fd)
        die(f"{path} is not FIXVADDR: pointers in it would not be valid on other hosts; "
            "use a new name")
    return fd


def write(lib, path, texts, clear):
    fd = open_fixvaddr(lib, path)
    try:
        with lib.mutex("notes:" + os.path.basename(path)):
            base = lib.rmap(fd)
            # Drop any copy this host cached before the lock: another host may
            # have appended since.
            size = os.fstat(fd).st_size
            if size:
                lib.rclearcache(base, size)
            head = head_of(lib, fd, create=True)
            if clear:
                for at, _, _ in list(nodes(head)):
                    lib.rfree(at)
                head.count, head.first, head.last = 0, 0, 0
            for text in texts:
                data = text.encode()
                at = lib.rmalloc(fd, ctypes.sizeof(Node) + len(data))
                node = Node.from_address(at)
                node.next, node.len = 0, len(data)
                ctypes.memmove(at + ctypes.sizeof(Node), data, len(data))
                if head.last:
                    Node.from_address(head.last).next = at
                else:
                    head.first = at
                head.last = at
                head.count += 1
            count = head.count
            # runmap writes every dirty page back (the heap may have grown
            # past the size fstat shows) before the mutex goes to the next
            # writer.
            lib.runmap(base)
    finally:
        os.close(fd)
    print(f"{count} notes")


def show(lib, path):
    fd = os.open(path, os.O_RDONLY)
    try:
        base = lib.rmap(fd)
        head = head_of(lib, fd, create=False)
        count = 0
        if head is not None:
            for _, _, text in nodes(head):
                print(text.decode(errors="replace"))
                count += 1
            if count != head.count:
                die(f"the list has {count} notes but its head counts {head.count}")
        lib.runmap(base)
    finally:
        os.close(fd)
    print(f"{count} notes")


def main():
    if len(sys.argv) < 3 or sys.argv[2] not in ("add", "list", "clear"):
        sys.exit(__doc__)
    path, cmd, texts = sys.argv[1], sys.argv[2], sys.argv[3:]
    try:
        lib = rc.load()
        if cmd == "list":
            show(lib, path)
        else:
            write(lib, path, texts, clear=cmd == "clear")
    except OSError as e:
        die(str(e))


if __name__ == "__main__":
    main()
