#!/usr/bin/env python3
"""POSIX file-system conformance checks for a mounted directory.

    python3 tests/posix/conformance.py DIR [--skip-links] [--json] [-k PATTERN]

Runs every check in a fresh subdirectory of DIR/posix-conformance.PID and
prints one line per check (``PASS name``, ``FAIL name: why`` or ``SKIP name:
why``) and a final line ``N passed, M failed, K skipped``.  Exits 1 if any
check failed, 2 on a usage error.  With --json the lines go to stderr and
stdout gets one JSON document with every result.

Must run as root: permission checks fork a child that drops to uid/gid 1000
and reports back through a pipe.  Python 3.11 standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import fnmatch
import hashlib
import json
import mmap
import os
import platform
import random
import select
import shutil
import signal
import stat
import sys
import time
import traceback
from collections import Counter
from typing import Callable

USER_UID = 1000
USER_GID = 1000
OTHER_UID = 1001
OTHER_GID = 1234  # a group uid 1000 is not in (unless given as supplementary)
OLD_NS = 1_000_000_000 * 10**9  # 2001-09-09, a timestamp far in the past
CHECK_TIMEOUT = 60.0
CHILD_TIMEOUT = 30.0


# --------------------------------------------------------------------------
# outcome types and small assertion helpers


class Skip(Exception):
    """The file system lacks an optional feature: report SKIP."""


class Fail(Exception):
    """A conformance failure: report FAIL."""


class Timeout(Exception):
    pass


def ename(e: int | None) -> str:
    if not e:
        return "success"
    if e == errno.EOPNOTSUPP:
        return "EOPNOTSUPP"  # == ENOTSUP on Linux; name it as the brief and man pages do
    return errno.errorcode.get(e, str(e))


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:60] + f"... ({len(v) if hasattr(v, '__len__') else '?'} long)"


def ok(cond, msg: str) -> None:
    if not cond:
        raise Fail(msg)


def eq(got, want, what: str) -> None:
    if got != want:
        if isinstance(got, (bytes, bytearray)) and isinstance(want, (bytes, bytearray)):
            if len(got) != len(want):
                raise Fail(f"{what}: {len(got)} bytes, expected {len(want)}")
            first = next(i for i in range(len(got)) if got[i] != want[i])
            raise Fail(f"{what}: differs first at byte {first} "
                       f"(got {got[first]:#04x}, expected {want[first]:#04x})")
        raise Fail(f"{what}: got {_short(got)}, expected {_short(want)}")


def oct_mode(m: int) -> str:
    return f"{m:#o}"


def expect_errno(expected, what: str, fn: Callable, *args, **kw) -> int:
    """Call fn and require it to fail with one of the expected errnos."""
    exp = expected if isinstance(expected, tuple) else (expected,)
    try:
        r = fn(*args, **kw)
    except OSError as e:
        if e.errno in exp:
            return e.errno
        raise Fail(f"{what}: failed with {ename(e.errno)}, expected "
                   f"{' or '.join(map(ename, exp))}") from None
    if isinstance(r, int) and fn is os.open:
        os.close(r)
    raise Fail(f"{what}: succeeded, expected {' or '.join(map(ename, exp))}")


def J(*parts: str) -> str:
    return os.path.join(*parts)


def writeall(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def readall(fd: int, chunk: int = 1 << 20) -> bytes:
    out = []
    while True:
        b = os.read(fd, chunk)
        if not b:
            return b"".join(out)
        out.append(b)


def wfile(path: str, data: bytes = b"", mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        writeall(fd, data)
    finally:
        os.close(fd)


def rfile(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return readall(fd)
    finally:
        os.close(fd)


def mode_of(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def tick() -> None:
    """Let the kernel's coarse clock advance so that time stamps differ."""
    time.sleep(0.03)


def rand(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)


# --------------------------------------------------------------------------
# libc bits the os module lacks

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2
_SYSCALLS = {  # (renameat2, getdents64)
    "x86_64": (316, 217),
    "aarch64": (276, 61),
    "riscv64": (276, 61),
}


def _cerr(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


def renameat2(src: str, dst: str, flags: int) -> None:
    fn = getattr(_libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        r = fn(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags)
    else:
        nr = _SYSCALLS.get(platform.machine(), (None, None))[0]
        if nr is None:
            raise Skip("no renameat2 in libc and unknown syscall number")
        _libc.syscall.restype = ctypes.c_long
        r = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(AT_FDCWD), os.fsencode(src),
                          ctypes.c_int(AT_FDCWD), os.fsencode(dst), ctypes.c_uint(flags))
    if r != 0:
        raise _cerr("renameat2")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def utimensat(path: str, atime, mtime) -> None:
    """atime/mtime: an int of nanoseconds, UTIME_NOW or UTIME_OMIT (as ('now'|'omit'))."""
    def ts(v):
        if v == "now":
            return _Timespec(0, UTIME_NOW)
        if v == "omit":
            return _Timespec(0, UTIME_OMIT)
        return _Timespec(v // 10**9, v % 10**9)
    times = (_Timespec * 2)(ts(atime), ts(mtime))
    _libc.utimensat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(_Timespec), ctypes.c_int]
    if _libc.utimensat(AT_FDCWD, os.fsencode(path), times, 0) != 0:
        raise _cerr("utimensat")


def getxattr_raw(path: str, name: str, size: int) -> int:
    _libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    _libc.getxattr.restype = ctypes.c_ssize_t
    buf = ctypes.create_string_buffer(max(size, 1))
    r = _libc.getxattr(os.fsencode(path), name.encode(), buf if size else None, size)
    if r < 0:
        raise _cerr("getxattr")
    return r


def getdents(path: str) -> list[tuple[int, int, bytes]]:
    """Raw getdents64: [(d_ino, d_type, name)], including '.' and '..'."""
    nr = _SYSCALLS.get(platform.machine(), (None, None))[1]
    if nr is None:
        raise Skip(f"getdents64 syscall number unknown on {platform.machine()}")
    _libc.syscall.restype = ctypes.c_long
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    out = []
    try:
        buf = ctypes.create_string_buffer(32768)
        while True:
            n = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(fd), buf, ctypes.c_uint(len(buf)))
            if n < 0:
                raise _cerr("getdents64")
            if n == 0:
                return out
            raw = buf.raw[:n]
            pos = 0
            while pos < n:
                ino = int.from_bytes(raw[pos:pos + 8], "little")
                reclen = int.from_bytes(raw[pos + 16:pos + 18], "little")
                dtype = raw[pos + 18]
                name = raw[pos + 19:pos + reclen].split(b"\0", 1)[0]
                out.append((ino, dtype, name))
                pos += reclen
    finally:
        os.close(fd)


# --------------------------------------------------------------------------
# children: other credentials, or code that may die of a signal


class State:
    user_ok = True
    user_reason = ""
    skip_links = False


def _run_child(fn: Callable, creds: tuple | None = None, timeout: float = CHILD_TIMEOUT):
    """Fork; in the child drop to creds=(uid, gid, groups) if given and run fn().

    Returns (payload, wait_status): payload is {"ok": value}, {"errno": n} or
    {"error": text}, or None when the child sent nothing (it exec'd or died).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(r)
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            try:
                if creds is not None:
                    uid, gid, groups = creds
                    os.setgroups(list(groups))
                    os.setgid(gid)
                    os.setuid(uid)
                res = {"ok": fn()}
            except OSError as e:
                res = {"errno": e.errno, "msg": str(e)}
            except BaseException as e:  # noqa: BLE001 - report anything
                res = {"error": f"{type(e).__name__}: {e}"}
            try:
                data = json.dumps(res).encode()
            except (TypeError, ValueError) as e:
                data = json.dumps({"error": f"unserialisable result: {e}"}).encode()
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise Fail(f"child process did not finish within {timeout:.0f} s")
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                b = os.read(r, 65536)
                if not b:
                    break
                chunks.append(b)
    finally:
        os.close(r)
    # The pipe closed; the child is exiting (or exec'd and runs on).
    while True:
        wpid, status = os.waitpid(pid, os.WNOHANG)
        if wpid:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise Fail(f"child process did not exit within {timeout:.0f} s")
        time.sleep(0.002)
    payload = json.loads(b"".join(chunks)) if chunks else None
    return payload, status


def as_user(fn: Callable, uid: int = USER_UID, gid: int = USER_GID, groups=()):
    """Run fn() as uid/gid; returns ("ok", value) or ("errno", n)."""
    if not State.user_ok:
        raise Skip(State.user_reason)
    payload, status = _run_child(fn, (uid, gid, tuple(groups)))
    if payload is None:
        raise Fail(f"child as uid {uid} sent no result (wait status {status:#x})")
    if "error" in payload:
        raise Fail(f"child as uid {uid}: {payload['error']}")
    if "errno" in payload:
        return "errno", payload["errno"]
    return "ok", payload["ok"]


def user_errno(fn: Callable, **kw) -> int:
    kind, v = as_user(fn, **kw)
    return v if kind == "errno" else 0


def user_ok(what: str, fn: Callable, **kw):
    kind, v = as_user(fn, **kw)
    if kind == "errno":
        raise Fail(f"{what} as uid {kw.get('uid', USER_UID)} failed with {ename(v)}")
    return v


def user_expect(expected, what: str, fn: Callable, **kw) -> None:
    exp = expected if isinstance(expected, tuple) else (expected,)
    e = user_errno(fn, **kw)
    if e not in exp:
        raise Fail(f"{what} as uid {kw.get('uid', USER_UID)}: got {ename(e)}, "
                   f"expected {' or '.join(map(ename, exp))}")


def in_child(fn: Callable):
    """Run fn() in a forked child with the same credentials; return (payload, status)."""
    return _run_child(fn, None)


def _open_close(path: str, flags: int, mode: int = 0o644):
    os.close(os.open(path, flags, mode))
    return True


# --------------------------------------------------------------------------
# check registry


class Check:
    def __init__(self, name: str, fn: Callable, area: str, links: bool):
        self.name, self.fn, self.area, self.links = name, fn, area, links


CHECKS: list[Check] = []
_AREA = ["misc"]


def area(name: str) -> None:
    _AREA[0] = name


def check(name: str, links: bool = False):
    def deco(fn):
        if any(c.name == name for c in CHECKS):
            raise RuntimeError(f"duplicate check {name}")
        CHECKS.append(Check(name, fn, _AREA[0], links))
        return fn
    return deco


def hard_link(src: str, dst: str) -> None:
    os.link(src, dst)


def sym_link(target: str, path: str) -> None:
    os.symlink(target, path)


def need_xattrs(d: str) -> str:
    """A file with user xattr support, or Skip when the FS has none."""
    p = J(d, "xattr-probe")
    wfile(p, b"x")
    try:
        os.setxattr(p, "user.probe", b"1")
        os.removexattr(p, "user.probe")
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise Skip(f"user xattrs unsupported ({ename(e.errno)})") from None
        raise
    return p


# ==========================================================================
# open / creat
area("open")


@check("open_creat_creates")
def _(d):
    p = J(d, "f")
    _open_close(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    st = os.stat(p)
    ok(stat.S_ISREG(st.st_mode), f"new file has mode {oct_mode(st.st_mode)}, not a regular file")
    eq(st.st_size, 0, "size of new file")
    ok("f" in os.listdir(d), "new file not listed in its directory")


@check("open_creat_excl_eexist")
def _(d):
    p = J(d, "f")
    wfile(p, b"data")
    expect_errno(errno.EEXIST, "O_CREAT|O_EXCL on existing file",
                 os.open, p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.mkdir(J(d, "sub"))
    expect_errno(errno.EEXIST, "O_CREAT|O_EXCL on existing directory",
                 os.open, J(d, "sub"), os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
    eq(rfile(p), b"data", "content after failed O_EXCL")


@check("open_creat_existing_keeps_data_and_mode")
def _(d):
    p = J(d, "f")
    wfile(p, b"keep me", 0o640)
    _open_close(p, os.O_RDWR | os.O_CREAT, 0o777)
    eq(rfile(p), b"keep me", "content after O_CREAT of existing file")
    eq(mode_of(p), 0o640, "mode after O_CREAT of existing file")


@check("open_creat_on_directory_eisdir")
def _(d):
    os.mkdir(J(d, "sub"))
    expect_errno(errno.EISDIR, "open(dir, O_RDWR|O_CREAT)",
                 os.open, J(d, "sub"), os.O_RDWR | os.O_CREAT, 0o644)


@check("open_trunc")
def _(d):
    p = J(d, "f")
    wfile(p, b"abcdefghij" * 100)
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    try:
        eq(os.fstat(fd).st_size, 0, "size right after O_TRUNC")
        writeall(fd, b"xy")
    finally:
        os.close(fd)
    eq(rfile(p), b"xy", "content after O_TRUNC and short write")


@check("open_append_two_fds")
def _(d):
    p = J(d, "f")
    wfile(p)
    a = os.open(p, os.O_WRONLY | os.O_APPEND)
    b = os.open(p, os.O_WRONLY | os.O_APPEND)
    want = []
    try:
        for i in range(100):
            for fd, tag in ((a, b"a"), (b, b"b")):
                rec = tag + b"%04d\n" % i
                writeall(fd, rec)
                want.append(rec)
    finally:
        os.close(a)
        os.close(b)
    eq(rfile(p), b"".join(want), "content after interleaved O_APPEND writes")


@check("open_append_concurrent_processes")
def _(d):
    p = J(d, "f")
    wfile(p)
    n, size = 400, 64

    def writer(tag):
        def run():
            fd = os.open(p, os.O_WRONLY | os.O_APPEND)
            try:
                for i in range(n):
                    rec = (b"%s%05d" % (tag, i)).ljust(size - 1, b".") + b"\n"
                    if os.write(fd, rec) != size:
                        raise RuntimeError("short write")
            finally:
                os.close(fd)
            return True
        return run

    sys.stdout.flush()
    pids = []
    for tag in (b"A", b"B", b"C"):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                writer(tag)()
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        ok(os.waitstatus_to_exitcode(status) == 0, "an appending child failed")
    data = rfile(p)
    eq(len(data), 3 * n * size, "size after concurrent appends")
    recs = [data[i:i + size] for i in range(0, len(data), size)]
    got = Counter(r[:6] for r in recs)
    want = Counter(b"%s%05d" % (t, i) for t in (b"A", b"B", b"C") for i in range(n))
    ok(got == want, "records lost, duplicated or torn by concurrent O_APPEND writers")
    ok(all(r.endswith(b".\n") for r in recs), "a record was torn by concurrent O_APPEND writers")


@check("open_append_ignores_seek")
def _(d):
    p = J(d, "f")
    wfile(p, b"0123456789")
    fd = os.open(p, os.O_RDWR | os.O_APPEND)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        writeall(fd, b"ab")
        eq(os.lseek(fd, 0, os.SEEK_CUR), 12, "offset after O_APPEND write")
    finally:
        os.close(fd)
    eq(rfile(p), b"0123456789ab", "content after seek + O_APPEND write")


@check("open_rdonly_write_ebadf")
def _(d):
    p = J(d, "f")
    wfile(p, b"data")
    fd = os.open(p, os.O_RDONLY)
    try:
        expect_errno(errno.EBADF, "write to O_RDONLY fd", os.write, fd, b"x")
        expect_errno(errno.EBADF, "pwrite to O_RDONLY fd", os.pwrite, fd, b"x", 0)
    finally:
        os.close(fd)
    eq(rfile(p), b"data", "content after refused writes")


@check("open_wronly_read_ebadf")
def _(d):
    p = J(d, "f")
    wfile(p, b"data")
    fd = os.open(p, os.O_WRONLY)
    try:
        expect_errno(errno.EBADF, "read from O_WRONLY fd", os.read, fd, 4)
    finally:
        os.close(fd)


@check("open_directory_on_file_enotdir")
def _(d):
    p = J(d, "f")
    wfile(p)
    expect_errno(errno.ENOTDIR, "open(file, O_DIRECTORY)", os.open, p, os.O_RDONLY | os.O_DIRECTORY)


@check("open_missing_enoent")
def _(d):
    expect_errno(errno.ENOENT, "open missing O_RDONLY", os.open, J(d, "nope"), os.O_RDONLY)
    expect_errno(errno.ENOENT, "open missing O_WRONLY", os.open, J(d, "nope"), os.O_WRONLY)
    expect_errno(errno.ENOENT, "stat missing", os.stat, J(d, "nope"))


@check("open_creat_missing_parent_enoent")
def _(d):
    expect_errno(errno.ENOENT, "O_CREAT in a missing directory",
                 os.open, J(d, "nodir", "f"), os.O_WRONLY | os.O_CREAT, 0o644)


@check("open_name_too_long_enametoolong")
def _(d):
    long = "n" * 256
    expect_errno(errno.ENAMETOOLONG, "O_CREAT of a 256-byte name",
                 os.open, J(d, long), os.O_WRONLY | os.O_CREAT, 0o644)
    expect_errno(errno.ENAMETOOLONG, "stat of a 256-byte name", os.stat, J(d, long))
    ok(long not in os.listdir(d), "a 256-byte name was created")
    ok255 = "m" * 255
    _open_close(J(d, ok255), os.O_WRONLY | os.O_CREAT, 0o644)
    ok(ok255 in os.listdir(d), "a 255-byte name is not listed")


@check("open_empty_path_enoent")
def _(d):
    expect_errno(errno.ENOENT, 'open("")', os.open, "", os.O_RDONLY)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        expect_errno(errno.ENOENT, 'openat(dirfd, "")', os.open, "", os.O_RDONLY, dir_fd=dfd)
    finally:
        os.close(dfd)


@check("open_through_file_enotdir")
def _(d):
    p = J(d, "f")
    wfile(p)
    expect_errno(errno.ENOTDIR, "open(file/x)", os.open, J(p, "x"), os.O_RDONLY)
    expect_errno(errno.ENOTDIR, "open(file/x, O_CREAT)", os.open, J(p, "x"), os.O_WRONLY | os.O_CREAT, 0o644)
    expect_errno(errno.ENOTDIR, "open(file/)", os.open, p + "/", os.O_RDONLY)
    expect_errno(errno.ENOTDIR, "stat(file/)", os.stat, p + "/")


@check("open_directory_for_write_eisdir")
def _(d):
    expect_errno(errno.EISDIR, "open(dir, O_WRONLY)", os.open, d, os.O_WRONLY)
    expect_errno(errno.EISDIR, "open(dir, O_RDWR)", os.open, d, os.O_RDWR)


@check("open_directory_rdonly")
def _(d):
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ok(stat.S_ISDIR(os.fstat(fd).st_mode), "fstat of a directory fd is not a directory")
    finally:
        os.close(fd)


@check("open_mode_bits_umask0")
def _(d):
    # only permission bits: POSIX leaves S_ISUID/S_ISGID/S_ISVTX in open()'s mode unspecified
    for m in (0o600, 0o640, 0o644, 0o755, 0o777, 0o000, 0o111, 0o421):
        p = J(d, f"f{m:o}")
        _open_close(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, m)
        eq(oct_mode(mode_of(p)), oct_mode(m), f"mode of file created with {oct_mode(m)}")


@check("open_umask_applied")
def _(d):
    old = os.umask(0o027)
    try:
        _open_close(J(d, "f"), os.O_WRONLY | os.O_CREAT, 0o666)
    finally:
        os.umask(old)
    eq(oct_mode(mode_of(J(d, "f"))), oct_mode(0o640), "mode of 0666 file under umask 027")


@check("openat_relative_to_dirfd")
def _(d):
    os.mkdir(J(d, "sub"))
    dfd = os.open(J(d, "sub"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=dfd)
        writeall(fd, b"at")
        os.close(fd)
        eq(os.stat("f", dir_fd=dfd).st_size, 2, "fstatat size")
    finally:
        os.close(dfd)
    eq(rfile(J(d, "sub", "f")), b"at", "content of file created by openat")


# ==========================================================================
# read / write / lseek
area("io")


@check("write_read_roundtrip")
def _(d):
    p = J(d, "f")
    data = rand(100_000)
    wfile(p, data)
    eq(rfile(p), data, "read back")


@check("write_visible_through_other_fd")
def _(d):
    p = J(d, "f")
    wfile(p)
    r = os.open(p, os.O_RDONLY)
    w = os.open(p, os.O_WRONLY)
    try:
        writeall(w, b"fresh bytes")
        eq(os.pread(r, 100, 0), b"fresh bytes", "read through an fd opened before the write")
        os.pwrite(w, b"FRESH", 0)
        eq(os.pread(r, 100, 0), b"FRESH bytes", "read after overwrite through another fd")
    finally:
        os.close(r)
        os.close(w)


@check("pwrite_pread_keep_offset")
def _(d):
    p = J(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        writeall(fd, b"0123456789")
        eq(os.pwrite(fd, b"AB", 3), 2, "pwrite return")
        eq(os.lseek(fd, 0, os.SEEK_CUR), 10, "offset after pwrite")
        eq(os.pread(fd, 4, 2), b"2AB5", "pread")
        eq(os.lseek(fd, 0, os.SEEK_CUR), 10, "offset after pread")
        eq(os.pread(fd, 100, 8), b"89", "pread across EOF")
    finally:
        os.close(fd)


@check("lseek_whence")
def _(d):
    p = J(d, "f")
    wfile(p, bytes(range(256)) * 4)
    fd = os.open(p, os.O_RDONLY)
    try:
        eq(os.lseek(fd, 0, os.SEEK_END), 1024, "SEEK_END")
        eq(os.lseek(fd, -10, os.SEEK_END), 1014, "SEEK_END -10")
        eq(os.lseek(fd, 5, os.SEEK_CUR), 1019, "SEEK_CUR +5")
        eq(os.read(fd, 100), bytes(range(251, 256)), "read after SEEK_CUR")
        eq(os.lseek(fd, 100, os.SEEK_SET), 100, "SEEK_SET")
        eq(os.read(fd, 2), bytes([100, 101]), "read after SEEK_SET")
    finally:
        os.close(fd)


@check("lseek_negative_einval")
def _(d):
    p = J(d, "f")
    wfile(p, b"x" * 100)
    fd = os.open(p, os.O_RDONLY)
    try:
        expect_errno(errno.EINVAL, "lseek(-1, SEEK_SET)", os.lseek, fd, -1, os.SEEK_SET)
        expect_errno(errno.EINVAL, "lseek(-200, SEEK_END)", os.lseek, fd, -200, os.SEEK_END)
        eq(os.lseek(fd, 0, os.SEEK_CUR), 0, "offset after failed lseek")
    finally:
        os.close(fd)


@check("lseek_past_eof_no_size_change")
def _(d):
    p = J(d, "f")
    wfile(p, b"x" * 100)
    fd = os.open(p, os.O_RDWR)
    try:
        eq(os.lseek(fd, 1 << 20, os.SEEK_SET), 1 << 20, "lseek past EOF")
        eq(os.fstat(fd).st_size, 100, "size after lseek past EOF")
        eq(os.read(fd, 10), b"", "read past EOF")
    finally:
        os.close(fd)


@check("write_past_eof_zero_hole")
def _(d):
    p = J(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    off = 3 * 131072 + 12345  # a hole spanning several 128 KiB chunks, unaligned
    try:
        writeall(fd, b"A")
        os.lseek(fd, off, os.SEEK_SET)
        writeall(fd, b"B")
        eq(os.fstat(fd).st_size, off + 1, "size after write past EOF")
    finally:
        os.close(fd)
    data = rfile(p)
    eq(len(data), off + 1, "bytes read")
    eq(data[0:1] + data[-1:], b"AB", "written bytes")
    ok(data[1:-1] == bytes(off - 1), "the hole does not read as zeros")


@check("pwrite_large_offset")
def _(d):
    p = J(d, "f")
    off = (1 << 32) + 4096 + 7
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            os.pwrite(fd, b"far", off)
        except OSError as e:
            if e.errno in (errno.EFBIG, errno.ENOSPC):
                raise Skip(f"no sparse 4 GiB offsets ({ename(e.errno)})") from None
            raise
        eq(os.fstat(fd).st_size, off + 3, "size after pwrite at 4 GiB")
        eq(os.pread(fd, 3, off), b"far", "pread at 4 GiB")
        eq(os.pread(fd, 4096, 1 << 31), bytes(4096), "hole at 2 GiB")
    finally:
        try:
            os.close(fd)
        except OSError as e:
            # A file system with a write-back cache may learn that it has no
            # room only when the buffered write is flushed, and reports it
            # at close, as NFS does.
            if e.errno in (errno.EFBIG, errno.ENOSPC):
                raise Skip(f"no sparse 4 GiB offsets ({ename(e.errno)} at close)") from None
            raise


@check("read_at_eof_returns_empty")
def _(d):
    p = J(d, "f")
    wfile(p, b"abc")
    fd = os.open(p, os.O_RDONLY)
    try:
        eq(os.read(fd, 4096), b"abc", "short read of small file")
        eq(os.read(fd, 4096), b"", "read at EOF")
        eq(os.pread(fd, 10, 3), b"", "pread at EOF")
        eq(os.pread(fd, 10, 1000), b"", "pread past EOF")
    finally:
        os.close(fd)


@check("write_zero_length")
def _(d):
    p = J(d, "f")
    wfile(p, b"abc")
    fd = os.open(p, os.O_WRONLY)
    try:
        eq(os.write(fd, b""), 0, "write of 0 bytes")
        eq(os.pwrite(fd, b"", 100), 0, "pwrite of 0 bytes past EOF")
    finally:
        os.close(fd)
    eq(os.stat(p).st_size, 3, "size after zero-length writes")


@check("overwrite_middle")
def _(d):
    p = J(d, "f")
    base = bytearray(b"a" * 300_000)
    wfile(p, bytes(base))
    fd = os.open(p, os.O_WRONLY)
    try:
        os.pwrite(fd, b"b" * 1000, 131000)  # across a 128 KiB boundary
        base[131000:132000] = b"b" * 1000
    finally:
        os.close(fd)
    eq(os.stat(p).st_size, 300_000, "size after overwrite")
    eq(rfile(p), bytes(base), "content after overwrite")


@check("unaligned_io_across_boundaries")
def _(d):
    p = J(d, "f")
    data = rand(600_000, 7)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        pos = 0
        rng = random.Random(3)
        while pos < len(data):  # irregular write sizes
            n = rng.choice((1, 7, 4095, 4097, 65537, 131073))
            pos += os.pwrite(fd, data[pos:pos + n], pos)
        for _ in range(200):
            off = rng.randrange(len(data))
            n = rng.choice((1, 3, 4096, 5000, 131072, 200_000))
            eq(os.pread(fd, n, off), data[off:off + n], f"pread({n}, {off})")
    finally:
        os.close(fd)


@check("readv_writev")
def _(d):
    p = J(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        eq(os.writev(fd, [b"ab", b"", b"cdef", b"g"]), 7, "writev return")
        os.lseek(fd, 0, os.SEEK_SET)
        bufs = [bytearray(3), bytearray(10)]
        eq(os.readv(fd, bufs), 7, "readv return")
        eq(bytes(bufs[0]) + bytes(bufs[1][:4]), b"abcdefg", "readv data")
    finally:
        os.close(fd)


@check("dup_shares_offset")
def _(d):
    p = J(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    fd2 = os.dup(fd)
    try:
        writeall(fd, b"one")
        writeall(fd2, b"two")
        eq(os.lseek(fd, 0, os.SEEK_CUR), 6, "shared offset")
    finally:
        os.close(fd)
        os.close(fd2)
    eq(rfile(p), b"onetwo", "content through dup'd fds")


@check("read_directory_eisdir")
def _(d):
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        expect_errno(errno.EISDIR, "read() on a directory fd", os.read, fd, 10)
    finally:
        os.close(fd)


@check("o_sync_o_dsync_writes")
def _(d):
    for flag, name in ((os.O_SYNC, "O_SYNC"), (os.O_DSYNC, "O_DSYNC")):
        p = J(d, name)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | flag, 0o644)
        try:
            writeall(fd, b"durable " * 1000)
        finally:
            os.close(fd)
        eq(rfile(p), b"durable " * 1000, f"content written with {name}")


@check("seek_data_hole")
def _(d):
    p = J(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    data_off = 1 << 20
    try:
        os.pwrite(fd, b"d" * 4096, data_off)
        size = data_off + 4096
        try:
            d0 = os.lseek(fd, 0, os.SEEK_DATA)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENXIO):
                raise Skip(f"SEEK_DATA unsupported ({ename(e.errno)})") from None
            raise
        ok(0 <= d0 <= data_off, f"SEEK_DATA from 0 gave {d0}, beyond the data at {data_off}")
        eq(os.lseek(fd, data_off + 10, os.SEEK_DATA), data_off + 10, "SEEK_DATA inside data")
        h0 = os.lseek(fd, 0, os.SEEK_HOLE)
        ok(h0 == size or (d0 > 0 and h0 == 0),
           f"SEEK_HOLE from 0 gave {h0} (data from {d0}, size {size})")
        eq(os.lseek(fd, data_off, os.SEEK_HOLE), size, "SEEK_HOLE from the data (implicit hole at EOF)")
        expect_errno(errno.ENXIO, "SEEK_DATA at EOF", os.lseek, fd, size, os.SEEK_DATA)
        expect_errno(errno.ENXIO, "SEEK_HOLE past EOF", os.lseek, fd, size + 1, os.SEEK_HOLE)
    finally:
        os.close(fd)


# ==========================================================================
# truncate / fallocate / fsync
area("truncate")


@check("ftruncate_shrink")
def _(d):
    p = J(d, "f")
    data = rand(200_000)
    wfile(p, data)
    fd = os.open(p, os.O_RDWR)
    try:
        os.ftruncate(fd, 70_000)
        eq(os.fstat(fd).st_size, 70_000, "size after ftruncate down")
    finally:
        os.close(fd)
    eq(rfile(p), data[:70_000], "content after ftruncate down")


@check("ftruncate_grow_zeros")
def _(d):
    p = J(d, "f")
    wfile(p, b"abc")
    fd = os.open(p, os.O_RDWR)
    try:
        os.ftruncate(fd, 300_000)
        eq(os.fstat(fd).st_size, 300_000, "size after ftruncate up")
    finally:
        os.close(fd)
    eq(rfile(p), b"abc" + bytes(300_000 - 3), "content after ftruncate up")


@check("truncate_path_down_and_up")
def _(d):
    p = J(d, "f")
    wfile(p, b"x" * 5000)
    os.truncate(p, 10)
    eq(os.stat(p).st_size, 10, "size after truncate down")
    os.truncate(p, 8000)
    eq(os.stat(p).st_size, 8000, "size after truncate up")
    eq(rfile(p), b"x" * 10 + bytes(7990), "content after truncate down and up")


@check("truncate_shrink_then_grow_no_stale_data")
def _(d):
    p = J(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        writeall(fd, b"S" * 400_000)
        os.fsync(fd)
        os.ftruncate(fd, 100)
        os.ftruncate(fd, 400_000)
        eq(os.pread(fd, 400_000, 0), b"S" * 100 + bytes(399_900),
           "old bytes reappeared after truncate down then up")
        # and once more with a write far past the truncation point
        os.ftruncate(fd, 50)
        os.pwrite(fd, b"E", 399_999)
        eq(os.pread(fd, 400_000, 0), b"S" * 50 + bytes(399_949) + b"E",
           "old bytes reappeared after truncate down then write past EOF")
    finally:
        os.close(fd)


@check("ftruncate_rdonly_fd_einval")
def _(d):
    p = J(d, "f")
    wfile(p, b"abc")
    fd = os.open(p, os.O_RDONLY)
    try:
        expect_errno((errno.EINVAL, errno.EBADF), "ftruncate on O_RDONLY fd", os.ftruncate, fd, 0)
    finally:
        os.close(fd)
    eq(os.stat(p).st_size, 3, "size after refused ftruncate")


@check("truncate_negative_einval")
def _(d):
    p = J(d, "f")
    wfile(p, b"abc")
    expect_errno(errno.EINVAL, "truncate(-1)", os.truncate, p, -1)
    eq(os.stat(p).st_size, 3, "size after refused truncate")


@check("truncate_directory_eisdir")
def _(d):
    expect_errno(errno.EISDIR, "truncate(dir)", os.truncate, d, 0)


@check("truncate_missing_enoent")
def _(d):
    expect_errno(errno.ENOENT, "truncate(missing)", os.truncate, J(d, "nope"), 0)


@check("truncate_updates_mtime_ctime")
def _(d):
    p = J(d, "f")
    wfile(p, b"x" * 100)
    os.utime(p, ns=(OLD_NS, OLD_NS))
    c0 = os.stat(p).st_ctime_ns
    tick()
    os.truncate(p, 10)
    st = os.stat(p)
    ok(st.st_mtime_ns > OLD_NS, "mtime unchanged by truncate")
    ok(st.st_ctime_ns > c0, "ctime unchanged by truncate")
    os.utime(p, ns=(OLD_NS, OLD_NS))
    c0 = os.stat(p).st_ctime_ns
    tick()
    fd = os.open(p, os.O_WRONLY)
    try:
        os.ftruncate(fd, 5000)
    finally:
        os.close(fd)
    st = os.stat(p)
    ok(st.st_mtime_ns > OLD_NS, "mtime unchanged by ftruncate")
    ok(st.st_ctime_ns > c0, "ctime unchanged by ftruncate")


@check("posix_fallocate_extends")
def _(d):
    p = J(d, "f")
    wfile(p, b"abc")
    fd = os.open(p, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 200_000)
        eq(os.fstat(fd).st_size, 200_000, "size after posix_fallocate")
        eq(os.pread(fd, 200_000, 0), b"abc" + bytes(199_997), "content after posix_fallocate")
    finally:
        os.close(fd)


@check("fsync_fdatasync")
def _(d):
    p = J(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        writeall(fd, b"x" * 10000)
        os.fsync(fd)
        os.pwrite(fd, b"y", 5)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)  # fsync through a read-only fd is allowed
    finally:
        os.close(fd)


@check("fsync_directory")
def _(d):
    wfile(J(d, "f"))
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ==========================================================================
# stat and times
area("stat")


@check("stat_size_follows_writes")
def _(d):
    p = J(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for n in (1, 4096, 131072, 131073, 500_000):
            os.pwrite(fd, b"z", n - 1)
            eq(os.fstat(fd).st_size, n, "fstat size")
            eq(os.stat(p).st_size, n, "stat size")
    finally:
        os.close(fd)


@check("stat_type_bits")
def _(d):
    wfile(J(d, "f"))
    os.mkdir(J(d, "sub"))
    eq(stat.S_IFMT(os.stat(J(d, "f")).st_mode), stat.S_IFREG, "file type bits")
    eq(stat.S_IFMT(os.stat(J(d, "sub")).st_mode), stat.S_IFDIR, "directory type bits")
    eq(stat.S_IFMT(os.stat(d).st_mode), stat.S_IFDIR, "test directory type bits")


@check("stat_file_nlink_one")
def _(d):
    wfile(J(d, "f"))
    eq(os.stat(J(d, "f")).st_nlink, 1, "st_nlink of a new file")


@check("stat_dir_nlink")
def _(d):
    s = J(d, "s")
    os.mkdir(s)
    eq(os.stat(s).st_nlink, 2, "st_nlink of an empty directory")
    for i in range(3):
        os.mkdir(J(s, f"c{i}"))
    eq(os.stat(s).st_nlink, 5, "st_nlink with 3 subdirectories")
    wfile(J(s, "file"))
    eq(os.stat(s).st_nlink, 5, "st_nlink after adding a file")
    os.rmdir(J(s, "c0"))
    eq(os.stat(s).st_nlink, 4, "st_nlink after rmdir of a subdirectory")
    os.mkdir(J(d, "t"))
    os.rename(J(s, "c1"), J(d, "t", "c1"))
    eq(os.stat(s).st_nlink, 3, "st_nlink of the source after moving a subdirectory out")
    eq(os.stat(J(d, "t")).st_nlink, 3, "st_nlink of the target after moving a subdirectory in")


@check("stat_new_owner_root")
def _(d):
    wfile(J(d, "f"))
    os.mkdir(J(d, "sub"))
    for n in ("f", "sub"):
        st = os.stat(J(d, n))
        eq((st.st_uid, st.st_gid), (0, 0), f"owner of {n} created by root")


@check("stat_new_owner_user")
def _(d):
    os.chmod(d, 0o777)

    def make():
        wfile(J(d, "f"))
        os.mkdir(J(d, "sub"))
        return [[os.stat(J(d, n)).st_uid, os.stat(J(d, n)).st_gid] for n in ("f", "sub")]
    got = user_ok("create", make)
    eq(got, [[USER_UID, USER_GID]] * 2, "owner (as seen by the user) of file and dir")
    for n in ("f", "sub"):
        st = os.stat(J(d, n))
        eq((st.st_uid, st.st_gid), (USER_UID, USER_GID), f"owner of {n} created by uid 1000")


@check("stat_inode_numbers")
def _(d):
    wfile(J(d, "a"))
    wfile(J(d, "b"))
    a, b = os.stat(J(d, "a")), os.stat(J(d, "b"))
    ok(a.st_ino != b.st_ino, "two files share an inode number")
    eq(a.st_dev, os.stat(d).st_dev, "st_dev of a file vs its directory")
    os.rename(J(d, "a"), J(d, "c"))
    eq(os.stat(J(d, "c")).st_ino, a.st_ino, "inode number after rename")
    fd = os.open(J(d, "c"), os.O_RDONLY)
    try:
        eq(os.fstat(fd).st_ino, a.st_ino, "fstat inode number")
    finally:
        os.close(fd)


@check("stat_blksize_sane")
def _(d):
    p = J(d, "f")
    wfile(p, b"x" * 10000)
    st = os.stat(p)
    ok(st.st_blksize > 0, f"st_blksize {st.st_blksize}")
    ok(st.st_blocks >= 0, f"st_blocks {st.st_blocks}")


@check("mtime_ctime_on_write")
def _(d):
    p = J(d, "f")
    wfile(p, b"abc")
    os.utime(p, ns=(OLD_NS, OLD_NS))
    c0 = os.stat(p).st_ctime_ns
    tick()
    fd = os.open(p, os.O_WRONLY)
    try:
        os.pwrite(fd, b"X", 1)
    finally:
        os.close(fd)
    st = os.stat(p)
    ok(st.st_mtime_ns > OLD_NS, "mtime unchanged by write")
    ok(st.st_ctime_ns > c0, "ctime unchanged by write")
    ok(st.st_mtime_ns <= time.time_ns() + 10**9, "mtime in the future")


@check("ctime_on_chmod_not_mtime")
def _(d):
    p = J(d, "f")
    wfile(p, b"abc")
    os.utime(p, ns=(OLD_NS, OLD_NS))
    c0 = os.stat(p).st_ctime_ns
    tick()
    os.chmod(p, 0o600)
    st = os.stat(p)
    ok(st.st_ctime_ns > c0, "ctime unchanged by chmod")
    eq(st.st_mtime_ns, OLD_NS, "mtime after chmod")


@check("ctime_on_chown")
def _(d):
    p = J(d, "f")
    wfile(p, b"abc")
    c0 = os.stat(p).st_ctime_ns
    tick()
    os.chown(p, USER_UID, USER_GID)
    ok(os.stat(p).st_ctime_ns > c0, "ctime unchanged by chown")


@check("dir_times_on_entry_change")
def _(d):
    s = J(d, "s")
    os.mkdir(s)
    for what, op in (("create", lambda: wfile(J(s, "f"))),
                     ("rename within", lambda: os.rename(J(s, "f"), J(s, "g"))),
                     ("unlink", lambda: os.unlink(J(s, "g"))),
                     ("mkdir", lambda: os.mkdir(J(s, "sub"))),
                     ("rmdir", lambda: os.rmdir(J(s, "sub")))):
        os.utime(s, ns=(OLD_NS, OLD_NS))
        c0 = os.stat(s).st_ctime_ns
        tick()
        op()
        st = os.stat(s)
        ok(st.st_mtime_ns > OLD_NS, f"directory mtime unchanged by {what}")
        ok(st.st_ctime_ns > c0, f"directory ctime unchanged by {what}")


@check("utime_explicit")
def _(d):
    p = J(d, "f")
    wfile(p)
    at, mt = 1_234_567_890_500_000_000, 1_111_111_111_250_000_000
    c0 = os.stat(p).st_ctime_ns
    tick()
    os.utime(p, ns=(at, mt))
    st = os.stat(p)
    for got, want, what in ((st.st_atime_ns, at, "atime"), (st.st_mtime_ns, mt, "mtime")):
        ok(got // 10**9 == want // 10**9 and got <= want and want - got < 10**9,
           f"{what} {got} after utime, expected {want}")
    ok(st.st_ctime_ns > c0, "ctime unchanged by utime")
    os.utime(d, ns=(at, mt))
    eq(os.stat(d).st_mtime_ns // 10**9, mt // 10**9, "directory mtime after utime")


@check("utime_now")
def _(d):
    p = J(d, "f")
    wfile(p)
    os.utime(p, ns=(OLD_NS, OLD_NS))
    before = time.time_ns()
    os.utime(p)  # utimensat(NULL): both UTIME_NOW
    after = time.time_ns()
    st = os.stat(p)
    for got, what in ((st.st_atime_ns, "atime"), (st.st_mtime_ns, "mtime")):
        ok(before - 2 * 10**9 <= got <= after + 2 * 10**9, f"{what} {got} not now ({before})")


@check("utimensat_now_and_omit")
def _(d):
    p = J(d, "f")
    wfile(p)
    os.utime(p, ns=(OLD_NS, OLD_NS))
    new = OLD_NS + 7 * 10**9
    utimensat(p, "omit", new)
    st = os.stat(p)
    eq(st.st_atime_ns, OLD_NS, "atime after UTIME_OMIT")
    eq(st.st_mtime_ns, new, "mtime set with atime UTIME_OMIT")
    utimensat(p, "now", "omit")
    st = os.stat(p)
    ok(abs(st.st_atime_ns - time.time_ns()) < 3 * 10**9, "atime after UTIME_NOW is not now")
    eq(st.st_mtime_ns, new, "mtime after UTIME_OMIT")


@check("utime_permissions")
def _(d):
    rw, ro = J(d, "rw"), J(d, "ro")
    wfile(rw, mode=0o666)
    wfile(ro, mode=0o644)
    user_expect(0, "utime(NULL) on a 0666 file of root", lambda: os.utime(rw))
    user_expect(errno.EPERM, "explicit utime on a file of root",
                lambda: os.utime(rw, ns=(OLD_NS, OLD_NS)))
    user_expect(errno.EACCES, "utime(NULL) on a 0644 file of root", lambda: os.utime(ro))
    own = J(d, "own")
    wfile(own, mode=0o444)
    os.chown(own, USER_UID, USER_GID)
    user_expect(0, "explicit utime on own read-only file", lambda: os.utime(own, ns=(OLD_NS, OLD_NS)))
    eq(os.stat(own).st_mtime_ns, OLD_NS, "mtime set by owner")


@check("atime_tolerated")
def _(d):
    p = J(d, "f")
    wfile(p, b"abc")
    os.utime(p, ns=(OLD_NS, OLD_NS))
    eq(rfile(p), b"abc", "read")
    st = os.stat(p)
    # relatime, strictatime and noatime are all fine: only sanity is required
    ok(OLD_NS <= st.st_atime_ns <= time.time_ns() + 2 * 10**9, f"atime {st.st_atime_ns} after read")
    eq(st.st_mtime_ns, OLD_NS, "mtime changed by a read")


# ==========================================================================
# unlink
area("unlink")


@check("unlink_removes_name")
def _(d):
    p = J(d, "f")
    wfile(p, b"x")
    os.unlink(p)
    expect_errno(errno.ENOENT, "stat after unlink", os.stat, p)
    ok("f" not in os.listdir(d), "unlinked name still listed")
    wfile(p, b"new")  # the name can be reused at once
    eq(rfile(p), b"new", "content of a re-created file")


@check("unlink_missing_enoent")
def _(d):
    expect_errno(errno.ENOENT, "unlink(missing)", os.unlink, J(d, "nope"))


@check("unlink_directory_eisdir")
def _(d):
    os.mkdir(J(d, "sub"))
    expect_errno(errno.EISDIR, "unlink(dir)", os.unlink, J(d, "sub"))
    ok(os.path.isdir(J(d, "sub")), "directory gone after refused unlink")


@check("unlink_through_file_enotdir")
def _(d):
    wfile(J(d, "f"))
    expect_errno(errno.ENOTDIR, "unlink(file/x)", os.unlink, J(d, "f", "x"))


@check("unlink_open_file_keeps_data")
def _(d):
    p = J(d, "f")
    data = rand(300_000, 5)
    wfile(p, data)
    fd = os.open(p, os.O_RDWR)
    try:
        os.unlink(p)
        expect_errno(errno.ENOENT, "stat after unlink", os.stat, p)
        eq(os.fstat(fd).st_nlink, 0, "st_nlink of an unlinked open file")
        eq(os.pread(fd, len(data), 0), data, "read through fd after unlink")
        os.pwrite(fd, b"more", len(data))
        eq(os.pread(fd, 4, len(data)), b"more", "write+read through fd after unlink")
        eq(os.fstat(fd).st_size, len(data) + 4, "size through fd after unlink")
        wfile(p, b"other")  # a new file of the same name is independent
        eq(os.pread(fd, 5, 0), data[:5], "unlinked file changed by a new file of the same name")
    finally:
        os.close(fd)
    eq(rfile(p), b"other", "new file of the same name")


@check("unlink_mapped_file_keeps_mapping")
def _(d):
    p = J(d, "f")
    wfile(p, b"m" * 8192)
    fd = os.open(p, os.O_RDWR)
    try:
        m = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        os.unlink(p)
        m[100:104] = b"post"
        eq(m[96:104], b"mmmmpost", "mapping of an unlinked file")
    finally:
        m.close()


# ==========================================================================
# rename
area("rename")


@check("rename_file")
def _(d):
    a, b = J(d, "a"), J(d, "b")
    wfile(a, b"content")
    ino = os.stat(a).st_ino
    os.rename(a, b)
    expect_errno(errno.ENOENT, "stat of the old name", os.stat, a)
    eq(rfile(b), b"content", "content after rename")
    eq(os.stat(b).st_ino, ino, "inode number after rename")
    eq(sorted(os.listdir(d)), ["b"], "directory listing after rename")


@check("rename_file_over_file")
def _(d):
    a, b = J(d, "a"), J(d, "b")
    wfile(a, b"new")
    wfile(b, b"old victim")
    ino = os.stat(a).st_ino
    fd = os.open(b, os.O_RDONLY)
    try:
        os.rename(a, b)
        eq(rfile(b), b"new", "content of the target after rename over it")
        eq(os.stat(b).st_ino, ino, "inode of the target name")
        eq(os.pread(fd, 100, 0), b"old victim", "open fd of the replaced file")
        eq(os.fstat(fd).st_nlink, 0, "st_nlink of the replaced file")
    finally:
        os.close(fd)
    eq(sorted(os.listdir(d)), ["b"], "listing after rename over a file")


@check("rename_dir_over_empty_dir")
def _(d):
    os.mkdir(J(d, "a"))
    wfile(J(d, "a", "inside"), b"i")
    os.mkdir(J(d, "b"))
    n0 = os.stat(d).st_nlink
    os.rename(J(d, "a"), J(d, "b"))
    eq(rfile(J(d, "b", "inside")), b"i", "content of moved directory")
    ok(not os.path.exists(J(d, "a")), "old directory name still exists")
    eq(os.stat(d).st_nlink, n0 - 1, "parent st_nlink after replacing a directory")


@check("rename_dir_over_nonempty_dir")
def _(d):
    os.mkdir(J(d, "a"))
    os.mkdir(J(d, "b"))
    wfile(J(d, "b", "keep"))
    expect_errno((errno.ENOTEMPTY, errno.EEXIST), "rename dir over non-empty dir",
                 os.rename, J(d, "a"), J(d, "b"))
    ok(os.path.isdir(J(d, "a")) and os.path.exists(J(d, "b", "keep")), "directories changed")


@check("rename_file_over_dir_eisdir")
def _(d):
    wfile(J(d, "f"))
    os.mkdir(J(d, "sub"))
    expect_errno(errno.EISDIR, "rename file over dir", os.rename, J(d, "f"), J(d, "sub"))


@check("rename_dir_over_file_enotdir")
def _(d):
    wfile(J(d, "f"))
    os.mkdir(J(d, "sub"))
    expect_errno(errno.ENOTDIR, "rename dir over file", os.rename, J(d, "sub"), J(d, "f"))


@check("rename_dir_into_own_subdir_einval")
def _(d):
    os.makedirs(J(d, "a", "b"))
    expect_errno(errno.EINVAL, "rename a -> a/b/c", os.rename, J(d, "a"), J(d, "a", "b", "c"))
    expect_errno(errno.EINVAL, "rename a -> a/x", os.rename, J(d, "a"), J(d, "a", "x"))
    ok(os.path.isdir(J(d, "a", "b")), "tree changed by refused rename")


@check("rename_to_same_name_noop")
def _(d):
    p = J(d, "f")
    wfile(p, b"same")
    os.rename(p, p)
    eq(rfile(p), b"same", "content after rename to itself")
    os.mkdir(J(d, "sub"))
    os.rename(J(d, "sub"), J(d, "sub"))
    ok(os.path.isdir(J(d, "sub")), "directory gone after rename to itself")


@check("rename_missing_enoent")
def _(d):
    expect_errno(errno.ENOENT, "rename(missing)", os.rename, J(d, "nope"), J(d, "x"))
    wfile(J(d, "f"))
    expect_errno(errno.ENOENT, "rename into a missing directory",
                 os.rename, J(d, "f"), J(d, "nodir", "f"))
    ok(os.path.exists(J(d, "f")), "source gone after refused rename")


@check("rename_dir_across_parents")
def _(d):
    os.makedirs(J(d, "p1", "child", "grand"))
    os.mkdir(J(d, "p2"))
    wfile(J(d, "p1", "child", "f"), b"deep")
    os.rename(J(d, "p1", "child"), J(d, "p2", "moved"))
    eq(rfile(J(d, "p2", "moved", "f")), b"deep", "content below moved directory")
    eq(os.stat(J(d, "p2", "moved", "..")).st_ino, os.stat(J(d, "p2")).st_ino, "'..' of moved directory")
    eq(os.stat(J(d, "p1")).st_nlink, 2, "st_nlink of the old parent")
    eq(os.stat(J(d, "p2")).st_nlink, 3, "st_nlink of the new parent")
    ok(os.path.isdir(J(d, "p2", "moved", "grand")), "grandchild missing after move")


@check("rename_keeps_open_fd")
def _(d):
    wfile(J(d, "a"), b"12345")
    fd = os.open(J(d, "a"), os.O_RDWR)
    try:
        os.mkdir(J(d, "sub"))
        os.rename(J(d, "a"), J(d, "sub", "b"))
        os.pwrite(fd, b"X", 0)
    finally:
        os.close(fd)
    eq(rfile(J(d, "sub", "b")), b"X2345", "write through an fd opened before rename")


@check("renameat2_noreplace")
def _(d):
    a, b = J(d, "a"), J(d, "b")
    wfile(a, b"A")
    wfile(b, b"B")
    try:
        renameat2(a, b, RENAME_NOREPLACE)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise Skip("RENAME_NOREPLACE unsupported (EINVAL)") from None
        if e.errno != errno.EEXIST:
            raise Fail(f"RENAME_NOREPLACE over existing: {ename(e.errno)}, expected EEXIST") from None
    else:
        raise Fail("RENAME_NOREPLACE over an existing file succeeded")
    eq((rfile(a), rfile(b)), (b"A", b"B"), "files after refused RENAME_NOREPLACE")
    try:  # the VFS answers EEXIST itself; only a free target reaches the file system
        renameat2(a, J(d, "c"), RENAME_NOREPLACE)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise Skip("RENAME_NOREPLACE unsupported (EINVAL for a free target)") from None
        raise
    eq(rfile(J(d, "c")), b"A", "RENAME_NOREPLACE to a free name")


@check("renameat2_exchange")
def _(d):
    a, b = J(d, "a"), J(d, "b")
    wfile(a, b"file A")
    os.mkdir(b)
    wfile(J(b, "inside"), b"i")
    ia, ib = os.stat(a).st_ino, os.stat(b).st_ino
    try:
        renameat2(a, b, RENAME_EXCHANGE)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise Skip("RENAME_EXCHANGE unsupported (EINVAL)") from None
        raise
    eq((os.stat(a).st_ino, os.stat(b).st_ino), (ib, ia), "inodes after RENAME_EXCHANGE")
    eq(rfile(b), b"file A", "file content after exchange")
    eq(rfile(J(a, "inside")), b"i", "directory content after exchange")
    expect_errno(errno.ENOENT, "RENAME_EXCHANGE with a missing target",
                 renameat2, b, J(d, "missing"), RENAME_EXCHANGE)


# ==========================================================================
# mkdir / rmdir
area("mkdir")


@check("mkdir_eexist")
def _(d):
    os.mkdir(J(d, "sub"))
    wfile(J(d, "f"))
    expect_errno(errno.EEXIST, "mkdir over a directory", os.mkdir, J(d, "sub"))
    expect_errno(errno.EEXIST, "mkdir over a file", os.mkdir, J(d, "f"))


@check("mkdir_missing_parent_enoent")
def _(d):
    expect_errno(errno.ENOENT, "mkdir in a missing directory", os.mkdir, J(d, "a", "b"))


@check("mkdir_through_file_enotdir")
def _(d):
    wfile(J(d, "f"))
    expect_errno(errno.ENOTDIR, "mkdir(file/x)", os.mkdir, J(d, "f", "x"))


@check("mkdir_name_too_long")
def _(d):
    expect_errno(errno.ENAMETOOLONG, "mkdir of a 256-byte name", os.mkdir, J(d, "d" * 256))
    os.mkdir(J(d, "d" * 255))


@check("mkdir_mode_umask0")
def _(d):
    # only permission bits: other bits in mkdir()'s mode are implementation-defined
    for m in (0o700, 0o750, 0o755, 0o777, 0o711, 0o000, 0o123):
        p = J(d, f"d{m:o}")
        os.mkdir(p, m)
        eq(oct_mode(mode_of(p)), oct_mode(m), f"mode of directory made with {oct_mode(m)}")


@check("mkdir_umask_applied")
def _(d):
    old = os.umask(0o022)
    try:
        os.mkdir(J(d, "sub"), 0o777)
    finally:
        os.umask(old)
    eq(oct_mode(mode_of(J(d, "sub"))), oct_mode(0o755), "mode of 0777 directory under umask 022")


area("rmdir")


@check("rmdir_removes")
def _(d):
    os.mkdir(J(d, "sub"))
    os.rmdir(J(d, "sub"))
    expect_errno(errno.ENOENT, "stat after rmdir", os.stat, J(d, "sub"))
    eq(os.listdir(d), [], "listing after rmdir")


@check("rmdir_nonempty_enotempty")
def _(d):
    os.makedirs(J(d, "a", "b"))
    expect_errno((errno.ENOTEMPTY, errno.EEXIST), "rmdir of a dir holding a dir", os.rmdir, J(d, "a"))
    os.mkdir(J(d, "c"))
    wfile(J(d, "c", "f"))
    expect_errno((errno.ENOTEMPTY, errno.EEXIST), "rmdir of a dir holding a file", os.rmdir, J(d, "c"))


@check("rmdir_file_enotdir")
def _(d):
    wfile(J(d, "f"))
    expect_errno(errno.ENOTDIR, "rmdir(file)", os.rmdir, J(d, "f"))
    ok(os.path.isfile(J(d, "f")), "file gone after refused rmdir")


@check("rmdir_missing_enoent")
def _(d):
    expect_errno(errno.ENOENT, "rmdir(missing)", os.rmdir, J(d, "nope"))


@check("rmdir_dot_einval")
def _(d):
    os.mkdir(J(d, "sub"))
    expect_errno(errno.EINVAL, "rmdir(dir/.)", os.rmdir, J(d, "sub", "."))


@check("rmdir_open_directory")
def _(d):
    s = J(d, "sub")
    os.mkdir(s)
    fd = os.open(s, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rmdir(s)
        expect_errno(errno.ENOENT, "create in a removed directory",
                     os.open, "f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        eq(os.fstat(fd).st_nlink, 0, "st_nlink of a removed open directory")
    finally:
        os.close(fd)


# ==========================================================================
# readdir
area("readdir")


def _mkfiles(d: str, names) -> None:
    for n in names:
        os.close(os.open(J(d, n), os.O_WRONLY | os.O_CREAT, 0o644))


@check("readdir_2000_entries")
def _(d):
    s = J(d, "big")
    os.mkdir(s)
    files = [f"entry-{i:05d}-{'p' * (i % 40)}" for i in range(1980)]
    dirs = [f"dir-{i:02d}" for i in range(20)]
    _mkfiles(s, files)
    for n in dirs:
        os.mkdir(J(s, n))
    seen = []
    kinds = {}
    with os.scandir(s) as it:
        for e in it:
            seen.append(e.name)
            kinds[e.name] = e.is_dir(follow_symlinks=False)
    dups = [n for n, c in Counter(seen).items() if c > 1]
    ok(not dups, f"{len(dups)} names returned twice, e.g. {dups[:3]}")
    missing = set(files + dirs) - set(seen)
    ok(not missing, f"{len(missing)} names missing, e.g. {sorted(missing)[:3]}")
    extra = set(seen) - set(files + dirs)
    ok(not extra, f"unexpected names {sorted(extra)[:3]}")
    wrong = [n for n in files if kinds[n]] + [n for n in dirs if not kinds[n]]
    ok(not wrong, f"wrong entry types for {wrong[:3]}")
    eq(os.stat(s).st_nlink, 22, "st_nlink of the big directory")


@check("readdir_dot_and_dotdot")
def _(d):
    s = J(d, "s")
    os.mkdir(s)
    wfile(J(s, "f"))
    os.mkdir(J(s, "sub"))
    ents = getdents(s)
    names = Counter(n for _, _, n in ents)
    eq(names[b"."], 1, "count of '.'")
    eq(names[b".."], 1, "count of '..'")
    eq(sorted(n for n in names if n not in (b".", b"..")), [b"f", b"sub"], "names")
    by = {n: (ino, t) for ino, t, n in ents}
    DT_UNKNOWN, DT_DIR, DT_REG = 0, 4, 8
    eq(by[b"."][0], os.stat(s).st_ino, "d_ino of '.'")
    eq(by[b"f"][0], os.stat(J(s, "f")).st_ino, "d_ino of a file")
    ok(by[b"f"][1] in (DT_REG, DT_UNKNOWN), f"d_type of a file is {by[b'f'][1]}")
    ok(by[b"sub"][1] in (DT_DIR, DT_UNKNOWN), f"d_type of a directory is {by[b'sub'][1]}")


@check("readdir_empty_dir")
def _(d):
    os.mkdir(J(d, "e"))
    eq(os.listdir(J(d, "e")), [], "listing of an empty directory")


@check("readdir_rewind")
def _(d):
    _mkfiles(d, [f"f{i}" for i in range(50)])
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        first = sorted(os.listdir(fd))
        second = sorted(os.listdir(fd))
    finally:
        os.close(fd)
    eq(len(first), 50, "entries in the first pass")
    eq(second, first, "entries after rewinding")


@check("readdir_modify_during_iteration")
def _(d):
    s = J(d, "s")
    os.mkdir(s)
    names = [f"old-{i:05d}-{'q' * 20}" for i in range(2000)]
    _mkfiles(s, names)
    removed = set(names[1000:1500])
    added = [f"new-{i:05d}-{'r' * 20}" for i in range(500)]
    seen = []
    with os.scandir(s) as it:
        for i, e in enumerate(it):
            seen.append(e.name)
            if i == 100:
                for n in removed:
                    os.unlink(J(s, n))
                _mkfiles(s, added)
    dups = [n for n, c in Counter(seen).items() if c > 1]
    ok(not dups, f"{len(dups)} names returned twice, e.g. {dups[:3]}")
    untouched = set(names) - removed
    missing = untouched - set(seen)
    ok(not missing, f"{len(missing)} untouched entries not returned, e.g. {sorted(missing)[:3]}")
    extra = set(seen) - set(names) - set(added)
    ok(not extra, f"unknown names returned: {sorted(extra)[:3]}")
    eq(sorted(os.listdir(s)), sorted(untouched | set(added)), "listing after the changes")


@check("readdir_unlink_while_iterating")
def _(d):
    s = J(d, "s")
    os.mkdir(s)
    names = [f"gone-{i:05d}-{'z' * 20}" for i in range(2000)]
    _mkfiles(s, names)
    seen = []
    with os.scandir(s) as it:
        for e in it:  # like rm -r: delete each entry as it is returned
            seen.append(e.name)
            os.unlink(J(s, e.name))
    ok(len(seen) == len(set(seen)), "names returned twice while unlinking")
    left = os.listdir(s)
    ok(not left, f"{len(left)} entries skipped by readdir while unlinking, e.g. {left[:3]}")
    os.rmdir(s)


@check("names_special_characters")
def _(d):
    names = ["sp ace", "ünïcødé-日本語", ".hidden", "-dash", "semi;colon", "tab\tname",
             "new\nline", "quote'\"", "back\\slash", "#%&*?[]{}", "x" * 255]
    _mkfiles(d, names)
    eq(sorted(os.listdir(d)), sorted(names), "listing of special names")
    for n in names:
        ok(os.path.isfile(J(d, n)), f"stat of {n!r}")


@check("names_arbitrary_bytes")
def _(d):
    names = [b"bad\xffname", b"\x01\x02ctl", b"latin1-\xe9"]
    bd = os.fsencode(d)
    for n in names:
        os.close(os.open(os.path.join(bd, n), os.O_WRONLY | os.O_CREAT, 0o644))
    eq(sorted(os.listdir(bd)), sorted(names), "listing of non-UTF-8 names")


# ==========================================================================
# chmod / chown
area("chmod")


@check("chmod_by_root")
def _(d):
    p = J(d, "f")
    wfile(p)
    for m in (0o000, 0o644, 0o4755, 0o2755, 0o1777, 0o7777, 0o600):
        os.chmod(p, m)
        eq(oct_mode(mode_of(p)), oct_mode(m), "file mode after chmod")
    s = J(d, "s")
    os.mkdir(s)
    for m in (0o700, 0o1777, 0o2775, 0o000, 0o755):
        os.chmod(s, m)
        eq(oct_mode(mode_of(s)), oct_mode(m), "directory mode after chmod")
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fchmod(fd, 0o640)
    finally:
        os.close(fd)
    eq(oct_mode(mode_of(p)), oct_mode(0o640), "mode after fchmod")


@check("chmod_by_owner")
def _(d):
    p = J(d, "f")
    wfile(p, mode=0o644)
    os.chown(p, USER_UID, USER_GID)
    user_expect(0, "chmod of own file", lambda: os.chmod(p, 0o600))
    eq(oct_mode(mode_of(p)), oct_mode(0o600), "mode after chmod by owner")


@check("chmod_by_nonowner_eperm")
def _(d):
    p = J(d, "f")
    wfile(p, mode=0o666)
    user_expect(errno.EPERM, "chmod of root's 0666 file", lambda: os.chmod(p, 0o777))
    eq(oct_mode(mode_of(p)), oct_mode(0o666), "mode after refused chmod")


@check("chmod_setgid_cleared_for_nonmember")
def _(d):
    p = J(d, "f")
    wfile(p, mode=0o644)
    os.chown(p, USER_UID, OTHER_GID)
    user_expect(0, "chmod g+s of own file in a foreign group", lambda: os.chmod(p, 0o2755))
    eq(oct_mode(mode_of(p)), oct_mode(0o755), "mode (S_ISGID must be dropped for a non-member)")


@check("chown_by_root")
def _(d):
    p = J(d, "f")
    wfile(p)
    os.chown(p, USER_UID, OTHER_GID)
    st = os.stat(p)
    eq((st.st_uid, st.st_gid), (USER_UID, OTHER_GID), "owner after chown")
    os.chown(p, -1, USER_GID)
    st = os.stat(p)
    eq((st.st_uid, st.st_gid), (USER_UID, USER_GID), "owner after chown(-1, gid)")
    os.chown(p, 0, -1)
    eq(os.stat(p).st_uid, 0, "uid after chown(uid, -1)")
    os.mkdir(J(d, "s"))
    os.chown(J(d, "s"), OTHER_UID, OTHER_GID)
    st = os.stat(J(d, "s"))
    eq((st.st_uid, st.st_gid), (OTHER_UID, OTHER_GID), "directory owner after chown")


@check("chown_by_nonowner_eperm")
def _(d):
    p = J(d, "f")
    wfile(p, mode=0o666)
    user_expect(errno.EPERM, "chown of root's file to self", lambda: os.chown(p, USER_UID, USER_GID))
    st = os.stat(p)
    eq((st.st_uid, st.st_gid), (0, 0), "owner after refused chown")


@check("chown_by_owner_limits")
def _(d):
    p = J(d, "f")
    wfile(p, mode=0o644)
    os.chown(p, USER_UID, USER_GID)
    user_expect(errno.EPERM, "give own file away to root", lambda: os.chown(p, 0, -1))
    user_expect(errno.EPERM, "chgrp own file to a group not a member of",
                lambda: os.chown(p, -1, OTHER_GID))
    user_expect(0, "chgrp own file to a supplementary group",
                lambda: os.chown(p, -1, OTHER_GID), groups=(OTHER_GID,))
    eq(os.stat(p).st_gid, OTHER_GID, "group after chgrp by owner")


@check("chown_clears_setuid")
def _(d):
    p = J(d, "f")
    wfile(p, b"#!/bin/sh\n")
    os.chown(p, USER_UID, USER_GID)
    os.chmod(p, 0o4755)
    user_expect(0, "chown of own setuid file", lambda: os.chown(p, -1, USER_GID))
    eq(oct_mode(mode_of(p)), oct_mode(0o755), "mode after unprivileged chown (S_ISUID must be cleared)")


@check("write_clears_setuid")
def _(d):
    p = J(d, "f")
    wfile(p, b"#!/bin/sh\n")
    os.chown(p, USER_UID, USER_GID)
    os.chmod(p, 0o4755)

    def w():
        fd = os.open(p, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"# more\n")
        finally:
            os.close(fd)
    user_expect(0, "append to own setuid file", w)
    eq(oct_mode(mode_of(p)), oct_mode(0o755), "mode after unprivileged write (S_ISUID must be cleared)")


# ==========================================================================
# permissions for uid 1000
area("permissions")


@check("perm_user_reaches_test_dir")
def _(d):
    if not State.user_ok:
        raise Fail(State.user_reason)
    user_expect(0, "listdir of the test directory", lambda: os.listdir(d))


@check("perm_file_read_bit")
def _(d):
    p = J(d, "f")
    wfile(p, b"secret", 0o600)
    user_expect(errno.EACCES, "open O_RDONLY of a 0600 root file", lambda: _open_close(p, os.O_RDONLY))
    os.chmod(p, 0o604)
    got = user_ok("read a 0604 root file", lambda: rfile(p).decode())
    eq(got, "secret", "content read by uid 1000")


@check("perm_file_write_bit")
def _(d):
    p = J(d, "f")
    wfile(p, b"orig", 0o644)
    user_expect(errno.EACCES, "open O_WRONLY of a 0644 root file", lambda: _open_close(p, os.O_WRONLY))
    user_expect(errno.EACCES, "open O_RDWR of a 0644 root file", lambda: _open_close(p, os.O_RDWR))
    eq(rfile(p), b"orig", "content after refused open")
    os.chmod(p, 0o646)
    user_expect(0, "write a 0646 root file", lambda: wfile(p, b"user"))
    eq(rfile(p), b"user", "content written by uid 1000")


@check("perm_file_exec_bit")
def _(d):
    if os.statvfs(d).f_flag & os.ST_NOEXEC:
        raise Skip("mounted noexec")
    p = J(d, "script")
    wfile(p, b"#!/bin/sh\nexit 7\n", 0o644)

    def run():
        os.execv(p, [p])
    for mode, want in ((0o644, "EACCES"), (0o754, "EACCES"), (0o755, 7), (0o745, 7)):
        os.chmod(p, mode)
        if not State.user_ok:
            raise Skip(State.user_reason)
        payload, status = _run_child(run, (USER_UID, USER_GID, ()))
        if payload is not None:
            got = ename(payload.get("errno")) if "errno" in payload else payload
        else:
            got = os.waitstatus_to_exitcode(status)
        eq(got, want, f"execve of a root script with mode {oct_mode(mode)} as uid 1000")
    os.chmod(p, 0o644)
    ok(user_ok("access(X_OK)", lambda: os.access(p, os.X_OK)) is False,
       "access(X_OK) of a 0644 file is true for uid 1000")
    os.chmod(p, 0o755)
    ok(user_ok("access(X_OK)", lambda: os.access(p, os.X_OK)) is True,
       "access(X_OK) of a 0755 file is false for uid 1000")


@check("perm_owner_class_precedence")
def _(d):
    p = J(d, "f")
    wfile(p, b"x", 0o077)
    os.chown(p, USER_UID, USER_GID)
    user_expect(errno.EACCES, "owner reading own 0077 file", lambda: _open_close(p, os.O_RDONLY))
    q = J(d, "g")
    wfile(q, b"x", 0o707)
    os.chown(q, 0, USER_GID)
    user_expect(errno.EACCES, "group member reading a 0707 file", lambda: _open_close(q, os.O_RDONLY))


@check("perm_group_bits")
def _(d):
    p = J(d, "f")
    wfile(p, b"x", 0o640)
    os.chown(p, 0, USER_GID)
    user_expect(0, "group member reads a 0640 file", lambda: _open_close(p, os.O_RDONLY))
    user_expect(errno.EACCES, "group member writes a 0640 file", lambda: _open_close(p, os.O_WRONLY))


@check("perm_supplementary_group")
def _(d):
    p = J(d, "f")
    wfile(p, b"x", 0o640)
    os.chown(p, 0, OTHER_GID)
    user_expect(errno.EACCES, "non-member reads a 0640 file", lambda: _open_close(p, os.O_RDONLY))
    user_expect(0, "supplementary member reads a 0640 file",
                lambda: _open_close(p, os.O_RDONLY), groups=(OTHER_GID,))


@check("perm_dir_search_bit")
def _(d):
    s = J(d, "s")
    os.mkdir(s, 0o755)
    wfile(J(s, "f"), b"x", 0o644)
    os.chmod(s, 0o766)  # others: rw-, no search
    user_expect(errno.EACCES, "stat below a directory without search permission",
                lambda: os.stat(J(s, "f")))
    user_expect(errno.EACCES, "open below a directory without search permission",
                lambda: _open_close(J(s, "f"), os.O_RDONLY))
    os.chmod(s, 0o711)
    user_expect(0, "open below a 0711 directory", lambda: _open_close(J(s, "f"), os.O_RDONLY))


@check("perm_dir_read_bit")
def _(d):
    s = J(d, "s")
    os.mkdir(s, 0o711)
    wfile(J(s, "f"), b"x", 0o644)
    user_expect(errno.EACCES, "listdir of a 0711 directory", lambda: os.listdir(s))
    os.chmod(s, 0o755)
    eq(user_ok("listdir of a 0755 directory", lambda: os.listdir(s)), ["f"], "listing as uid 1000")


@check("perm_dir_write_to_create")
def _(d):
    s = J(d, "s")
    os.mkdir(s, 0o755)
    user_expect(errno.EACCES, "create in a 0755 root directory",
                lambda: _open_close(J(s, "f"), os.O_WRONLY | os.O_CREAT))
    user_expect(errno.EACCES, "mkdir in a 0755 root directory", lambda: os.mkdir(J(s, "d")))
    os.chmod(s, 0o776)  # write without search
    user_expect(errno.EACCES, "create in a directory with write but no search",
                lambda: _open_close(J(s, "f"), os.O_WRONLY | os.O_CREAT))
    os.chmod(s, 0o757)
    user_expect(0, "create in a 0757 directory", lambda: _open_close(J(s, "f"), os.O_WRONLY | os.O_CREAT))
    user_expect(0, "mkdir in a 0757 directory", lambda: os.mkdir(J(s, "d")))
    eq(sorted(os.listdir(s)), ["d", "f"], "entries created by uid 1000")


@check("perm_dir_write_to_unlink_and_rename")
def _(d):
    s = J(d, "s")
    os.mkdir(s, 0o755)
    wfile(J(s, "f"), b"x", 0o666)
    user_expect(errno.EACCES, "unlink in a 0755 root directory", lambda: os.unlink(J(s, "f")))
    user_expect(errno.EACCES, "rename in a 0755 root directory", lambda: os.rename(J(s, "f"), J(s, "g")))
    ok(os.path.exists(J(s, "f")), "file gone after refused unlink")
    os.chmod(s, 0o757)
    user_expect(0, "rename in a 0757 directory", lambda: os.rename(J(s, "f"), J(s, "g")))
    user_expect(0, "unlink in a 0757 directory", lambda: os.unlink(J(s, "g")))
    eq(os.listdir(s), [], "listing after unlink by uid 1000")


@check("perm_root_overrides_mode")
def _(d):
    p = J(d, "f")
    wfile(p, b"root reads", 0o000)
    eq(rfile(p), b"root reads", "root reading a 0000 file")
    wfile(p, b"root writes", 0o000)
    s = J(d, "s")
    os.mkdir(s, 0o000)
    wfile(J(s, "f"))
    eq(os.listdir(s), ["f"], "root listing a 0000 directory")


@check("perm_creat_existing_needs_write")
def _(d):
    os.chmod(d, 0o777)
    p = J(d, "f")
    wfile(p, b"root", 0o644)
    user_expect(errno.EACCES, "O_CREAT|O_WRONLY of an existing 0644 root file",
                lambda: _open_close(p, os.O_WRONLY | os.O_CREAT))
    user_expect(errno.EACCES, "O_TRUNC of an existing 0644 root file",
                lambda: _open_close(p, os.O_WRONLY | os.O_TRUNC))
    eq(rfile(p), b"root", "content after refused opens")


@check("perm_truncate_needs_write")
def _(d):
    p = J(d, "f")
    wfile(p, b"12345", 0o644)
    user_expect(errno.EACCES, "truncate of a 0644 root file", lambda: os.truncate(p, 0))
    eq(os.stat(p).st_size, 5, "size after refused truncate")
    os.chmod(p, 0o646)
    user_expect(0, "truncate of a 0646 root file", lambda: os.truncate(p, 2))
    eq(os.stat(p).st_size, 2, "size after truncate by uid 1000")


@check("perm_checked_at_open_not_io")
def _(d):
    os.chmod(d, 0o777)
    p = J(d, "f")

    def run():
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.chmod(p, 0o400)
            os.write(fd, b"still writable")
            try:
                _open_close(p, os.O_WRONLY)
            except OSError as e:
                return e.errno
            return 0
        finally:
            os.close(fd)
    e = user_ok("write through an fd opened before chmod 0400", run)
    eq(ename(e), "EACCES", "new O_WRONLY open of own 0400 file")
    eq(rfile(p), b"still writable", "content written through the old fd")


@check("sticky_dir_unlink_eperm")
def _(d):
    s = J(d, "tmp")
    os.mkdir(s)
    os.chmod(s, 0o1777)
    eq(oct_mode(mode_of(s)), oct_mode(0o1777), "mode of sticky directory")
    wfile(J(s, "roots"), b"r", 0o666)
    wfile(J(s, "others"), b"o", 0o666)
    os.chown(J(s, "others"), OTHER_UID, OTHER_GID)
    user_expect(errno.EPERM, "unlink of root's file in a sticky dir", lambda: os.unlink(J(s, "roots")))
    user_expect(errno.EPERM, "unlink of uid 1001's file in a sticky dir", lambda: os.unlink(J(s, "others")))
    user_expect(errno.EPERM, "rename of another's file in a sticky dir",
                lambda: os.rename(J(s, "others"), J(s, "mine")))
    ok(os.path.exists(J(s, "roots")) and os.path.exists(J(s, "others")), "files gone after refused unlink")

    def own():
        wfile(J(s, "own"), b"u")
        os.rename(J(s, "own"), J(s, "own2"))
        os.unlink(J(s, "own2"))
    user_expect(0, "create, rename and unlink own file in a sticky dir", own)


@check("setgid_dir_inherits_group")
def _(d):
    s = J(d, "sg")
    os.mkdir(s)
    os.chown(s, 0, OTHER_GID)
    os.chmod(s, 0o2777)
    eq(oct_mode(mode_of(s)), oct_mode(0o2777), "mode of setgid directory")

    def make():
        wfile(J(s, "f"))
        os.mkdir(J(s, "sub"), 0o755)
        return True
    user_ok("create in a setgid directory", make)
    eq(os.stat(J(s, "f")).st_gid, OTHER_GID, "group of a file made in a setgid dir")
    st = os.stat(J(s, "sub"))
    eq(st.st_gid, OTHER_GID, "group of a subdirectory made in a setgid dir")
    ok(st.st_mode & stat.S_ISGID, f"subdirectory of a setgid dir lacks S_ISGID ({oct_mode(st.st_mode)})")
    wfile(J(s, "rootfile"))
    eq(os.stat(J(s, "rootfile")).st_gid, OTHER_GID, "group of root's file in a setgid dir")
    plain = J(d, "plain")
    os.mkdir(plain, 0o777)
    os.chown(plain, 0, OTHER_GID)
    user_ok("create in a plain directory", lambda: wfile(J(plain, "f")))
    eq(os.stat(J(plain, "f")).st_gid, USER_GID, "group of a file made in a non-setgid dir")


# ==========================================================================
# extended attributes
area("xattr")


@check("xattr_set_get")
def _(d):
    p = need_xattrs(d)
    os.setxattr(p, "user.test", b"value one")
    eq(os.getxattr(p, "user.test"), b"value one", "getxattr")
    os.setxattr(p, "user.test", b"v2")
    eq(os.getxattr(p, "user.test"), b"v2", "getxattr after overwrite with a shorter value")


@check("xattr_list")
def _(d):
    p = need_xattrs(d)
    eq([n for n in os.listxattr(p) if n.startswith("user.")], [], "user xattrs of a new file")
    names = [f"user.attr{i:02d}" for i in range(40)]
    for n in names:
        os.setxattr(p, n, n.encode())
    got = [n for n in os.listxattr(p) if n.startswith("user.")]
    eq(sorted(got), names, "listxattr")
    for n in names:
        eq(os.getxattr(p, n), n.encode(), f"value of {n}")


@check("xattr_remove")
def _(d):
    p = need_xattrs(d)
    os.setxattr(p, "user.a", b"1")
    os.setxattr(p, "user.b", b"2")
    os.removexattr(p, "user.a")
    expect_errno(errno.ENODATA, "getxattr after removexattr", os.getxattr, p, "user.a")
    eq([n for n in os.listxattr(p) if n.startswith("user.")], ["user.b"], "listxattr after remove")


@check("xattr_create_flag_eexist")
def _(d):
    p = need_xattrs(d)
    os.setxattr(p, "user.c", b"first", os.XATTR_CREATE)
    expect_errno(errno.EEXIST, "XATTR_CREATE of an existing name",
                 os.setxattr, p, "user.c", b"second", os.XATTR_CREATE)
    eq(os.getxattr(p, "user.c"), b"first", "value after refused XATTR_CREATE")


@check("xattr_replace_flag_enodata")
def _(d):
    p = need_xattrs(d)
    expect_errno(errno.ENODATA, "XATTR_REPLACE of a missing name",
                 os.setxattr, p, "user.r", b"x", os.XATTR_REPLACE)
    expect_errno(errno.ENODATA, "getxattr after refused XATTR_REPLACE", os.getxattr, p, "user.r")
    os.setxattr(p, "user.r", b"one")
    os.setxattr(p, "user.r", b"two", os.XATTR_REPLACE)
    eq(os.getxattr(p, "user.r"), b"two", "value after XATTR_REPLACE")


@check("xattr_missing_enodata")
def _(d):
    p = need_xattrs(d)
    expect_errno(errno.ENODATA, "getxattr of a missing name", os.getxattr, p, "user.none")
    expect_errno(errno.ENODATA, "removexattr of a missing name", os.removexattr, p, "user.none")


@check("xattr_value_too_big")
def _(d):
    p = need_xattrs(d)
    expect_errno((errno.E2BIG, errno.ENOSPC), "setxattr of a 64 KiB + 1 value",
                 os.setxattr, p, "user.big", b"b" * 65537)
    expect_errno(errno.ENODATA, "getxattr after refused big value", os.getxattr, p, "user.big")


@check("xattr_name_too_long_erange")
def _(d):
    p = need_xattrs(d)
    expect_errno(errno.ERANGE, "setxattr with a 261-byte name", os.setxattr, p, "user." + "n" * 256, b"1")


@check("xattr_small_buffer_erange")
def _(d):
    p = need_xattrs(d)
    os.setxattr(p, "user.sz", b"twelve bytes")
    eq(getxattr_raw(p, "user.sz", 0), 12, "getxattr size query")
    expect_errno(errno.ERANGE, "getxattr into a 4-byte buffer", getxattr_raw, p, "user.sz", 4)


@check("xattr_empty_and_binary_values")
def _(d):
    p = need_xattrs(d)
    os.setxattr(p, "user.empty", b"")
    eq(os.getxattr(p, "user.empty"), b"", "empty value")
    blob = rand(2000, 9) + b"\0\0end"
    os.setxattr(p, "user.blob", blob)
    eq(os.getxattr(p, "user.blob"), blob, "binary value with NULs")


@check("xattr_on_directory")
def _(d):
    need_xattrs(d)
    s = J(d, "s")
    os.mkdir(s)
    os.setxattr(s, "user.dir", b"d")
    eq(os.getxattr(s, "user.dir"), b"d", "xattr of a directory")
    os.removexattr(s, "user.dir")


@check("xattr_fd_calls")
def _(d):
    p = need_xattrs(d)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.setxattr(fd, "user.fd", b"through fd")
        eq(os.getxattr(fd, "user.fd"), b"through fd", "fgetxattr")
        ok("user.fd" in os.listxattr(fd), "flistxattr")
        os.removexattr(fd, "user.fd")
    finally:
        os.close(fd)
    expect_errno(errno.ENODATA, "getxattr after fremovexattr", os.getxattr, p, "user.fd")


@check("xattr_unknown_namespace_eopnotsupp")
def _(d):
    p = need_xattrs(d)
    expect_errno(errno.EOPNOTSUPP, "setxattr in namespace 'bogus.'", os.setxattr, p, "bogus.name", b"1")


@check("xattr_permissions")
def _(d):
    p = need_xattrs(d)
    os.chmod(p, 0o644)
    os.setxattr(p, "user.p", b"v")
    user_expect(errno.EACCES, "setxattr on a 0644 root file", lambda: os.setxattr(p, "user.q", b"1"))
    user_expect(errno.EACCES, "removexattr on a 0644 root file", lambda: os.removexattr(p, "user.p"))
    eq(user_ok("getxattr on a 0644 root file", lambda: os.getxattr(p, "user.p").decode()), "v",
       "value read by uid 1000")
    os.chmod(p, 0o600)
    user_expect(errno.EACCES, "getxattr on a 0600 root file", lambda: os.getxattr(p, "user.p"))
    os.chmod(p, 0o666)
    user_expect(0, "setxattr on a 0666 root file", lambda: os.setxattr(p, "user.q", b"1"))
    eq(os.getxattr(p, "user.q"), b"1", "value set by uid 1000")


@check("xattr_survives_rename")
def _(d):
    p = need_xattrs(d)
    os.setxattr(p, "user.keep", b"kept")
    os.rename(p, J(d, "renamed"))
    eq(os.getxattr(J(d, "renamed"), "user.keep"), b"kept", "xattr after rename")


# ==========================================================================
# statvfs
area("statvfs")


@check("statvfs_sane")
def _(d):
    v = os.statvfs(d)
    ok(v.f_bsize > 0 and v.f_frsize > 0, f"block sizes {v.f_bsize}/{v.f_frsize}")
    ok(v.f_blocks > 0, f"f_blocks {v.f_blocks}")
    ok(v.f_blocks >= v.f_bfree >= v.f_bavail >= 0,
       f"f_blocks {v.f_blocks}, f_bfree {v.f_bfree}, f_bavail {v.f_bavail} out of order")
    ok(v.f_files >= v.f_ffree >= 0 and v.f_ffree >= v.f_favail >= 0,
       f"f_files {v.f_files}, f_ffree {v.f_ffree}, f_favail {v.f_favail} out of order")
    ok(v.f_namemax >= 255, f"f_namemax {v.f_namemax}")


@check("fstatvfs_matches_statvfs")
def _(d):
    wfile(J(d, "f"))
    a = os.statvfs(J(d, "f"))
    fd = os.open(J(d, "f"), os.O_RDONLY)
    try:
        b = os.fstatvfs(fd)
    finally:
        os.close(fd)
    eq((a.f_bsize, a.f_frsize, a.f_blocks, a.f_namemax),
       (b.f_bsize, b.f_frsize, b.f_blocks, b.f_namemax), "statvfs vs fstatvfs")


# ==========================================================================
# mmap
area("mmap")

PAGE = mmap.PAGESIZE


def _map(p: str, size: int, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE):
    fd = os.open(p, os.O_RDWR)
    try:
        return mmap.mmap(fd, size, flags, prot)
    finally:
        os.close(fd)


@check("mmap_shared_write_msync_read")
def _(d):
    p = J(d, "f")
    size = 3 * PAGE + 100
    wfile(p, bytes(size))
    data = rand(size, 11)
    m = _map(p, size)
    try:
        m[:] = data
        m.flush()  # msync(MS_SYNC)
    finally:
        m.close()
    eq(rfile(p), data, "read() after mmap write + msync")


@check("mmap_write_visible_to_read_without_msync")
def _(d):
    p = J(d, "f")
    wfile(p, bytes(2 * PAGE))
    m = _map(p, 2 * PAGE)
    fd = os.open(p, os.O_RDONLY)
    try:
        m[PAGE - 2:PAGE + 2] = b"span"
        eq(os.pread(fd, 4, PAGE - 2), b"span", "read() of a page dirtied through mmap")
    finally:
        os.close(fd)
        m.close()


@check("mmap_sees_write")
def _(d):
    p = J(d, "f")
    wfile(p, bytes(2 * PAGE))
    m = _map(p, 2 * PAGE, prot=mmap.PROT_READ)
    try:
        eq(m[10:14], bytes(4), "mapping before write")
        fd = os.open(p, os.O_WRONLY)
        try:
            os.pwrite(fd, b"seen", 10)
            os.pwrite(fd, b"late", PAGE + 5)
        finally:
            os.close(fd)
        eq(m[10:14], b"seen", "mapping after write() to a faulted page")
        eq(m[PAGE + 5:PAGE + 9], b"late", "mapping after write() to an unfaulted page")
    finally:
        m.close()


@check("mmap_msync_updates_mtime")
def _(d):
    p = J(d, "f")
    wfile(p, bytes(PAGE))
    os.utime(p, ns=(OLD_NS, OLD_NS))
    m = _map(p, PAGE)
    try:
        m[0:5] = b"dirty"
        m.flush()
    finally:
        m.close()
    eq(rfile(p)[:5], b"dirty", "data after msync")
    st = os.stat(p)
    if st.st_mtime_ns == OLD_NS:
        raise Fail("mtime not updated between a write through MAP_SHARED and msync")


@check("mmap_two_mappings_coherent")
def _(d):
    p = J(d, "f")
    wfile(p, bytes(PAGE * 2))
    a = _map(p, PAGE * 2)
    b = _map(p, PAGE * 2)
    try:
        a[100:105] = b"hello"
        eq(b[100:105], b"hello", "second mapping sees the first's write")
        b[PAGE:PAGE + 3] = b"bye"
        eq(a[PAGE:PAGE + 3], b"bye", "first mapping sees the second's write")
    finally:
        a.close()
        b.close()


@check("mmap_private_is_private")
def _(d):
    p = J(d, "f")
    wfile(p, b"o" * PAGE)
    m = _map(p, PAGE, flags=mmap.MAP_PRIVATE)
    try:
        m[0:4] = b"priv"
        eq(m[0:4], b"priv", "private mapping")
    finally:
        m.close()
    eq(rfile(p)[:4], b"oooo", "file after a MAP_PRIVATE write")


@check("mmap_after_ftruncate_grow")
def _(d):
    p = J(d, "f")
    wfile(p, b"start")
    fd = os.open(p, os.O_RDWR)
    try:
        os.ftruncate(fd, 4 * PAGE)
        m = mmap.mmap(fd, 4 * PAGE, mmap.MAP_SHARED)
        try:
            eq(m[0:5], b"start", "old data through the mapping")
            eq(m[5:4 * PAGE], bytes(4 * PAGE - 5), "grown part through the mapping")
            m[3 * PAGE:3 * PAGE + 3] = b"end"
            m.flush()
        finally:
            m.close()
        eq(os.pread(fd, 3, 3 * PAGE), b"end", "read of data written through the mapping")
    finally:
        os.close(fd)


@check("mmap_beyond_eof_sigbus")
def _(d):
    p = J(d, "f")
    wfile(p, b"t" * (3 * PAGE))

    def child():
        m = _map(p, 3 * PAGE)
        os.truncate(p, 100)
        tail = m[100:PAGE]
        if tail != bytes(PAGE - 100):
            return "tail of the last page is not zero after truncate"
        m[2 * PAGE + 1]  # a page wholly past EOF: must raise SIGBUS
        return "no SIGBUS touching a page past EOF"
    payload, status = in_child(child)
    if payload is not None:
        raise Fail(str(payload.get("ok") or payload))
    ok(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGBUS,
       f"child ended with wait status {status:#x}, expected SIGBUS")


# ==========================================================================
# large file
area("large")


@check("large_file_64mib_checksum")
def _(d):
    p = J(d, "big")
    mib = 1 << 20
    seeds = [random.Random(i).randbytes(mib - 8) for i in range(4)]

    def block(i: int) -> bytes:  # every MiB differs: 4 random patterns + the block number
        return seeds[i % 4] + i.to_bytes(8, "little")
    h = hashlib.sha256()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(64):
            writeall(fd, block(i))
            h.update(block(i))
        os.fsync(fd)
    finally:
        os.close(fd)
    eq(os.stat(p).st_size, 64 * mib, "size of the 64 MiB file")
    fd = os.open(p, os.O_RDONLY)
    try:
        h2 = hashlib.sha256()
        while True:
            b = os.read(fd, 1_000_003)  # unaligned reads
            if not b:
                break
            h2.update(b)
        eq(h2.hexdigest(), h.hexdigest(), "sha256 of the 64 MiB file read back")
        rng = random.Random(5)
        for _ in range(64):
            off = rng.randrange(64 * mib - 5000)
            i, o = divmod(off, mib)
            want = (block(i) + (block(i + 1) if i + 1 < 64 else b""))[o:o + 5000]
            eq(os.pread(fd, 5000, off), want, f"pread at {off}")
    finally:
        os.close(fd)
    os.unlink(p)


# ==========================================================================
# hard links and symlinks
area("links")


@check("link_basic", links=True)
def _(d):
    a, b = J(d, "a"), J(d, "b")
    wfile(a, b"shared")
    hard_link(a, b)
    sa, sb = os.stat(a), os.stat(b)
    eq(sa.st_ino, sb.st_ino, "inode of both names")
    eq((sa.st_nlink, sb.st_nlink), (2, 2), "st_nlink of both names")
    wfile(b, b"changed via b")
    eq(rfile(a), b"changed via b", "content through the other name")


@check("link_unlink_one_name", links=True)
def _(d):
    a, b = J(d, "a"), J(d, "b")
    wfile(a, b"survives")
    hard_link(a, b)
    os.unlink(a)
    eq(rfile(b), b"survives", "content after unlinking the other name")
    eq(os.stat(b).st_nlink, 1, "st_nlink after unlinking one name")


@check("link_existing_eexist", links=True)
def _(d):
    a, b = J(d, "a"), J(d, "b")
    wfile(a)
    wfile(b)
    hard_link(a, J(d, "c"))
    expect_errno(errno.EEXIST, "link over an existing name", os.link, a, b)


@check("link_directory_eperm", links=True)
def _(d):
    os.mkdir(J(d, "s"))
    expect_errno(errno.EPERM, "hard link to a directory", os.link, J(d, "s"), J(d, "t"))


@check("link_missing_enoent", links=True)
def _(d):
    expect_errno(errno.ENOENT, "link of a missing file", os.link, J(d, "nope"), J(d, "x"))


@check("link_updates_ctime", links=True)
def _(d):
    a = J(d, "a")
    wfile(a)
    c0 = os.stat(a).st_ctime_ns
    tick()
    hard_link(a, J(d, "b"))
    ok(os.stat(a).st_ctime_ns > c0, "ctime unchanged by link")


@check("link_rename_same_inode_noop", links=True)
def _(d):
    a, b = J(d, "a"), J(d, "b")
    wfile(a, b"x")
    hard_link(a, b)
    os.rename(a, b)  # both names are the same file: POSIX says do nothing
    ok(os.path.exists(a) and os.path.exists(b), "rename between hard links of one file removed a name")
    eq(os.stat(b).st_nlink, 2, "st_nlink after rename between links")


@check("link_open_unlinked_count", links=True)
def _(d):
    a, b = J(d, "a"), J(d, "b")
    wfile(a, b"x")
    hard_link(a, b)
    fd = os.open(a, os.O_RDONLY)
    try:
        os.unlink(a)
        eq(os.fstat(fd).st_nlink, 1, "st_nlink after unlinking one of two names")
        os.unlink(b)
        eq(os.fstat(fd).st_nlink, 0, "st_nlink after unlinking both names")
        eq(os.pread(fd, 1, 0), b"x", "read after unlinking both names")
    finally:
        os.close(fd)


@check("symlink_basic", links=True)
def _(d):
    t, l = J(d, "target"), J(d, "link")
    wfile(t, b"through the link")
    sym_link("target", l)
    eq(os.readlink(l), "target", "readlink")
    st = os.lstat(l)
    ok(stat.S_ISLNK(st.st_mode), f"lstat mode {oct_mode(st.st_mode)} is not a symlink")
    eq(st.st_size, len("target"), "st_size of a symlink")
    eq(os.stat(l).st_ino, os.stat(t).st_ino, "stat follows the link")
    eq(rfile(l), b"through the link", "read through the link")


@check("symlink_dangling", links=True)
def _(d):
    l = J(d, "link")
    sym_link("nowhere", l)
    expect_errno(errno.ENOENT, "stat of a dangling link", os.stat, l)
    ok(stat.S_ISLNK(os.lstat(l).st_mode), "lstat of a dangling link")
    fd = os.open(l, os.O_WRONLY | os.O_CREAT, 0o644)  # creates the target
    os.close(fd)
    ok(os.path.isfile(J(d, "nowhere")), "O_CREAT through a dangling link did not create the target")


@check("symlink_loop_eloop", links=True)
def _(d):
    sym_link("b", J(d, "a"))
    sym_link("a", J(d, "b"))
    expect_errno(errno.ELOOP, "stat of a symlink loop", os.stat, J(d, "a"))
    expect_errno(errno.ELOOP, "open of a symlink loop", os.open, J(d, "a"), os.O_RDONLY)


@check("symlink_o_nofollow_eloop", links=True)
def _(d):
    wfile(J(d, "t"))
    sym_link("t", J(d, "l"))
    expect_errno(errno.ELOOP, "open(symlink, O_NOFOLLOW)", os.open, J(d, "l"), os.O_RDONLY | os.O_NOFOLLOW)


@check("symlink_existing_eexist", links=True)
def _(d):
    wfile(J(d, "f"))
    sym_link("x", J(d, "l"))
    expect_errno(errno.EEXIST, "symlink over a file", os.symlink, "x", J(d, "f"))
    expect_errno(errno.EEXIST, "symlink over a symlink", os.symlink, "x", J(d, "l"))


@check("readlink_not_symlink_einval", links=True)
def _(d):
    wfile(J(d, "f"))
    expect_errno(errno.EINVAL, "readlink of a file", os.readlink, J(d, "f"))
    expect_errno(errno.EINVAL, "readlink of a directory", os.readlink, d)


@check("symlink_long_target", links=True)
def _(d):
    target = "/".join(["component"] * 100)[:1000]
    sym_link(target, J(d, "l"))
    eq(os.readlink(J(d, "l")), target, "readlink of a 1000-byte target")


@check("symlink_to_directory", links=True)
def _(d):
    os.mkdir(J(d, "real"))
    wfile(J(d, "real", "f"), b"via dir link")
    sym_link("real", J(d, "dl"))
    eq(rfile(J(d, "dl", "f")), b"via dir link", "path through a directory symlink")
    eq(os.listdir(J(d, "dl")), ["f"], "listing through a directory symlink")
    expect_errno(errno.ENOTDIR, "rmdir of a symlink to a directory", os.rmdir, J(d, "dl"))


@check("symlink_rename_and_unlink", links=True)
def _(d):
    wfile(J(d, "t"), b"target")
    sym_link("t", J(d, "l"))
    os.rename(J(d, "l"), J(d, "l2"))
    eq(os.readlink(J(d, "l2")), "t", "readlink after renaming the link")
    os.unlink(J(d, "l2"))
    eq(rfile(J(d, "t")), b"target", "target after unlinking the link")
    eq(sorted(os.listdir(d)), ["t"], "listing after unlinking the link")


@check("symlink_lchown", links=True)
def _(d):
    wfile(J(d, "t"))
    sym_link("t", J(d, "l"))
    os.lchown(J(d, "l"), USER_UID, USER_GID)
    eq((os.lstat(J(d, "l")).st_uid, os.stat(J(d, "t")).st_uid), (USER_UID, 0),
       "owners of link and target after lchown")


@check("symlink_lstat_and_stat", links=True)
def _(d):
    wfile(J(d, "t"), b"12345")
    sym_link("t", J(d, "l"))
    st = os.lstat(J(d, "l"))
    ok(stat.S_ISLNK(st.st_mode), f"lstat of a symlink: mode {st.st_mode:#o}")
    eq(st.st_size, 1, "st_size of a symlink (its target's length)")
    eq(st.st_nlink, 1, "st_nlink of a symlink")
    ok(stat.S_ISREG(os.stat(J(d, "l")).st_mode), "stat follows the symlink")
    eq(os.stat(J(d, "l")).st_size, 5, "size through the symlink")
    eq(os.lstat(J(d, "l")).st_ino != os.stat(J(d, "t")).st_ino, True, "link and target are two inodes")


@check("symlink_chain_and_too_many_levels_eloop", links=True)
def _(d):
    wfile(J(d, "t"), b"end")
    prev = "t"
    for i in range(41):
        sym_link(prev, J(d, f"l{i}"))
        prev = f"l{i}"
    eq(rfile(J(d, "l10")), b"end", "read through 11 symlinks")
    expect_errno(errno.ELOOP, "open through 41 symlinks", os.open, J(d, "l40"), os.O_RDONLY)


@check("symlink_relative_and_absolute_targets", links=True)
def _(d):
    os.mkdir(J(d, "sub"))
    wfile(J(d, "f"), b"top")
    sym_link("../f", J(d, "sub", "up"))
    sym_link(os.path.abspath(J(d, "f")), J(d, "abs"))
    eq(rfile(J(d, "sub", "up")), b"top", "read through a ../ target")
    eq(rfile(J(d, "abs")), b"top", "read through an absolute target")
    eq(os.readlink(J(d, "abs")), os.path.abspath(J(d, "f")), "readlink of an absolute target")


@check("symlink_open_creat_through_dangling", links=True)
def _(d):
    sym_link("made", J(d, "l"))
    fd = os.open(J(d, "l"), os.O_WRONLY | os.O_CREAT, 0o600)
    writeall(fd, b"created through a link")
    os.close(fd)
    eq(rfile(J(d, "made")), b"created through a link", "target created by O_CREAT through a dangling symlink")
    expect_errno(errno.EEXIST, "O_CREAT|O_EXCL on a symlink", os.open, J(d, "l"),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)


@check("symlink_nofollow_times", links=True)
def _(d):
    wfile(J(d, "t"))
    sym_link("t", J(d, "l"))
    os.utime(J(d, "t"), ns=(OLD_NS, OLD_NS))
    os.utime(J(d, "l"), ns=(OLD_NS + 10**9, OLD_NS + 2 * 10**9), follow_symlinks=False)
    eq(os.lstat(J(d, "l")).st_mtime_ns, OLD_NS + 2 * 10**9, "mtime of the link (AT_SYMLINK_NOFOLLOW)")
    eq(os.stat(J(d, "t")).st_mtime_ns, OLD_NS, "mtime of the target untouched")
    os.utime(J(d, "l"), ns=(OLD_NS, OLD_NS + 3 * 10**9))
    eq(os.stat(J(d, "t")).st_mtime_ns, OLD_NS + 3 * 10**9, "utime through the link sets the target's")


@check("symlink_chmod_follows", links=True)
def _(d):
    wfile(J(d, "t"), mode=0o644)
    sym_link("t", J(d, "l"))
    os.chmod(J(d, "l"), 0o600)
    eq(oct_mode(mode_of(J(d, "t"))), oct_mode(0o600), "mode of the target after chmod of the link")
    eq(oct_mode(mode_of(J(d, "l"))), oct_mode(0o777), "mode of the link itself")


@check("symlink_target_limits", links=True)
def _(d):
    longest = "x" * 4095
    sym_link(longest, J(d, "l"))
    eq(os.readlink(J(d, "l")), longest, "readlink of a 4095-byte target")
    expect_errno(errno.ENAMETOOLONG, "symlink with a 4096-byte target", os.symlink, "x" * 4096, J(d, "m"))
    expect_errno(errno.ENOENT, "symlink with an empty target", os.symlink, "", J(d, "e"))
    expect_errno(errno.ENAMETOOLONG, "symlink named 256 bytes", os.symlink, "t", J(d, "n" * 256))


@check("symlink_needs_write_on_directory", links=True)
def _(d):
    os.chmod(d, 0o755)
    user_expect(errno.EACCES, "symlink in root's 0755 directory", lambda: os.symlink("t", J(d, "l")))
    os.chmod(d, 0o777)
    user_expect(0, "symlink in a 0777 directory", lambda: os.symlink("t", J(d, "l")))
    eq(os.lstat(J(d, "l")).st_uid, USER_UID, "owner of a user's symlink")


@check("readdir_types_of_links_and_special_files", links=True)
def _(d):
    wfile(J(d, "f"))
    os.mkdir(J(d, "sub"))
    sym_link("f", J(d, "l"))
    os.mkfifo(J(d, "p"))
    types = {name.decode(): t for _, t, name in getdents(d) if name not in (b".", b"..")}
    want = {"f": 8, "sub": 4, "l": 10, "p": 1}  # DT_REG, DT_DIR, DT_LNK, DT_FIFO
    for name, t in want.items():
        # DT_UNKNOWN (0) is allowed: callers must then lstat.
        ok(types.get(name) in (t, 0), f"d_type of {name}: {types.get(name)}, expected {t}")


@check("link_three_names_share_data_and_mode", links=True)
def _(d):
    os.mkdir(J(d, "other"))
    wfile(J(d, "a"), b"one")
    hard_link(J(d, "a"), J(d, "b"))
    hard_link(J(d, "a"), J(d, "other", "c"))
    eq(os.stat(J(d, "a")).st_nlink, 3, "nlink with three names")
    fd = os.open(J(d, "other", "c"), os.O_WRONLY | os.O_APPEND)
    writeall(fd, b"+two")
    os.close(fd)
    eq(rfile(J(d, "b")), b"one+two", "write through one name read through another")
    os.chmod(J(d, "b"), 0o600)
    eq(oct_mode(mode_of(J(d, "a"))), oct_mode(0o600), "chmod through one name seen through another")
    os.unlink(J(d, "a"))
    os.unlink(J(d, "b"))
    eq(os.stat(J(d, "other", "c")).st_nlink, 1, "nlink after removing two names")
    eq(rfile(J(d, "other", "c")), b"one+two", "data kept by the last name")
    os.unlink(J(d, "other", "c"))
    os.rmdir(J(d, "other"))


@check("link_xattrs_shared", links=True)
def _(d):
    p = need_xattrs(d)
    hard_link(p, J(d, "twin"))
    os.setxattr(p, "user.colour", b"red")
    eq(os.getxattr(J(d, "twin"), "user.colour"), b"red", "xattr set on one name read through another")
    os.removexattr(J(d, "twin"), "user.colour")
    expect_errno(errno.ENODATA, "xattr removed through the other name", os.getxattr, p, "user.colour")


@check("link_rename_over_one_name", links=True)
def _(d):
    wfile(J(d, "a"), b"a")
    hard_link(J(d, "a"), J(d, "a2"))
    wfile(J(d, "b"), b"b")
    os.rename(J(d, "b"), J(d, "a2"))
    eq(os.stat(J(d, "a")).st_nlink, 1, "nlink after another file replaced one name")
    eq(rfile(J(d, "a")), b"a", "data of the surviving name")
    eq(rfile(J(d, "a2")), b"b", "data of the replacing file")
    hard_link(J(d, "a"), J(d, "a3"))
    os.rename(J(d, "a3"), J(d, "moved"))
    eq(os.stat(J(d, "moved")).st_ino, os.stat(J(d, "a")).st_ino, "a renamed link is the same inode")
    eq(os.stat(J(d, "a")).st_nlink, 2, "nlink after renaming a link")


@check("link_to_a_symlink", links=True)
def _(d):
    sym_link("target", J(d, "l"))
    os.link(J(d, "l"), J(d, "l2"), follow_symlinks=False)
    eq(os.readlink(J(d, "l2")), "target", "readlink of a hard link to a symlink")
    eq(os.lstat(J(d, "l")).st_nlink, 2, "nlink of a hard-linked symlink")


@check("link_protected_hardlinks", links=True)
def _(d):
    try:
        with open("/proc/sys/fs/protected_hardlinks") as f:
            protected = f.read().strip() == "1"
    except OSError:
        protected = False
    os.chmod(d, 0o777)
    wfile(J(d, "secret"), b"s", 0o600)
    wfile(J(d, "shared"), b"s", 0o666)
    user_expect(errno.EPERM if protected else 0, "link to root's 0600 file",
                lambda: os.link(J(d, "secret"), J(d, "mine")))
    user_expect(0, "link to root's 0666 file", lambda: os.link(J(d, "shared"), J(d, "mine2")))


# ==========================================================================
# FIFOs, sockets and device nodes: entries without file data
area("special files")


@check("mkfifo_stat_and_umask")
def _(d):
    old = os.umask(0o022)
    try:
        os.mkfifo(J(d, "p"), 0o666)
    finally:
        os.umask(old)
    st = os.lstat(J(d, "p"))
    ok(stat.S_ISFIFO(st.st_mode), f"mode of a FIFO: {st.st_mode:#o}")
    eq(oct_mode(stat.S_IMODE(st.st_mode)), oct_mode(0o644), "FIFO mode after umask 022")
    eq(st.st_size, 0, "size of a FIFO")
    expect_errno(errno.EEXIST, "mkfifo over an existing FIFO", os.mkfifo, J(d, "p"))


@check("fifo_carries_data_within_a_host")
def _(d):
    p = J(d, "p")
    os.mkfifo(p, 0o600)
    r = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    try:
        w = os.open(p, os.O_WRONLY)
        try:
            writeall(w, b"through the fifo")
        finally:
            os.close(w)
        eq(os.read(r, 100), b"through the fifo", "bytes read from the FIFO")
    finally:
        os.close(r)

    def writer():
        fd = os.open(p, os.O_WRONLY)  # blocks until the parent opens for reading
        writeall(fd, b"from a child")
        os.close(fd)
        return True
    pid = os.fork()
    if pid == 0:
        try:
            writer()
        finally:
            os._exit(0)
    fd = os.open(p, os.O_RDONLY)
    try:
        eq(readall(fd), b"from a child", "bytes from another process")
    finally:
        os.close(fd)
        os.waitpid(pid, 0)


@check("fifo_rename_and_unlink")
def _(d):
    os.mkfifo(J(d, "p"))
    os.rename(J(d, "p"), J(d, "q"))
    ok(stat.S_ISFIFO(os.lstat(J(d, "q")).st_mode), "a renamed FIFO is a FIFO")
    os.unlink(J(d, "q"))
    ok(not os.path.lexists(J(d, "q")), "unlinked FIFO")


@check("mknod_devices_regular_and_fifo")
def _(d):
    os.mknod(J(d, "c"), stat.S_IFCHR | 0o600, os.makedev(1, 7))
    os.mknod(J(d, "b"), stat.S_IFBLK | 0o600, os.makedev(7, 200))
    os.mknod(J(d, "r"), stat.S_IFREG | 0o640)
    os.mknod(J(d, "p"), stat.S_IFIFO | 0o640)
    c, b = os.lstat(J(d, "c")), os.lstat(J(d, "b"))
    ok(stat.S_ISCHR(c.st_mode) and stat.S_ISBLK(b.st_mode), "types of device nodes")
    eq((os.major(c.st_rdev), os.minor(c.st_rdev)), (1, 7), "st_rdev of a character device")
    eq((os.major(b.st_rdev), os.minor(b.st_rdev)), (7, 200), "st_rdev of a block device")
    ok(stat.S_ISREG(os.lstat(J(d, "r")).st_mode), "mknod S_IFREG makes a regular file")
    wfile(J(d, "r"), b"data")
    eq(rfile(J(d, "r")), b"data", "a mknod'ed regular file holds data")
    ok(stat.S_ISFIFO(os.lstat(J(d, "p")).st_mode), "mknod S_IFIFO makes a FIFO")
    os.chmod(d, 0o777)
    user_expect(errno.EPERM, "mknod of a device by uid 1000",
                lambda: os.mknod(J(d, "u"), stat.S_IFCHR | 0o600, os.makedev(1, 3)))
    user_expect(0, "mkfifo by uid 1000", lambda: os.mkfifo(J(d, "up")))


@check("unix_socket_bind_connect")
def _(d):
    import socket
    path = J(d, "sock")
    if len(os.fsencode(os.path.abspath(path))) >= 108:
        raise Skip("socket path longer than sun_path")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(path)
        ok(stat.S_ISSOCK(os.lstat(path).st_mode), "bind makes a socket entry")
        srv.listen(1)
        cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        cli.settimeout(5)
        try:
            cli.connect(path)
            conn, _ = srv.accept()
            cli.sendall(b"over a unix socket")
            conn.settimeout(5)
            eq(conn.recv(100), b"over a unix socket", "bytes through the bound socket")
            conn.close()
        finally:
            cli.close()
    finally:
        srv.close()
    expect_errno(errno.EADDRINUSE, "bind to an existing socket path",
                 socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).bind, path)
    os.unlink(path)


# ==========================================================================
# the kernel's rules for permission bits
area("permission rules")


@check("ftruncate_of_own_mode0_file_opened_rdwr")
def _(d):
    os.chmod(d, 0o777)
    p = J(d, "f")

    def run():
        fd = os.open(p, os.O_CREAT | os.O_RDWR, 0)
        try:
            os.ftruncate(fd, 1000)
            os.pwrite(fd, b"tail", 996)
            return os.fstat(fd).st_size
        finally:
            os.close(fd)
    eq(user_ok("ftruncate of a descriptor opened O_CREAT|O_RDWR with mode 0", run), 1000,
       "size after ftruncate")
    eq(oct_mode(mode_of(p)), oct_mode(0), "mode of the file")
    user_expect(errno.EACCES, "truncate(path) of the mode 0 file", lambda: os.truncate(p, 0))


@check("write_by_nonowner_clears_setuid_setgid")
def _(d):
    p = J(d, "f")
    wfile(p, b"x", 0o644)
    os.chmod(p, 0o6777)

    def w():
        fd = os.open(p, os.O_WRONLY | os.O_APPEND)
        try:
            return os.write(fd, b"more")
        finally:
            os.close(fd)
    eq(user_ok("write to root's 06777 file", w), 4, "bytes written")
    eq(oct_mode(mode_of(p)), oct_mode(0o777), "mode after a write by a non-owner")
    os.chmod(p, 0o2767)
    user_ok("write to root's 02767 file", w)
    eq(oct_mode(mode_of(p)), oct_mode(0o767), "setgid of a group uid 1000 is not in, after its write")
    os.chmod(p, 0o2767)
    user_ok("write to root's 02767 file as a member of its group", w, groups=(0,))
    eq(oct_mode(mode_of(p)), oct_mode(0o2767), "setgid kept for a member when the group may not execute")
    eq(rfile(p), b"xmoremoremore", "content")


@check("sticky_dir_owner_and_rename_over")
def _(d):
    os.chmod(d, 0o777)
    s = J(d, "tmp")
    os.mkdir(s)
    os.chown(s, USER_UID, USER_GID)
    os.chmod(s, 0o1777)
    wfile(J(s, "roots"), b"r", 0o666)
    user_expect(0, "owner of a sticky directory unlinks root's file", lambda: os.unlink(J(s, "roots")))
    t = J(d, "tmp2")
    os.mkdir(t)
    os.chmod(t, 0o1777)
    wfile(J(t, "roots"), b"r", 0o666)

    def over():
        wfile(J(t, "mine"), b"m")
        os.rename(J(t, "mine"), J(t, "roots"))
    user_expect(errno.EPERM, "rename over root's file in root's sticky dir", over)
    eq(rfile(J(t, "roots")), b"r", "the target of the refused rename")


@check("utimensat_omit_both_needs_nothing")
def _(d):
    p = J(d, "f")
    wfile(p, mode=0o644)
    os.utime(p, ns=(OLD_NS, OLD_NS))
    user_expect(0, "utimensat(UTIME_OMIT, UTIME_OMIT) on root's 0644 file",
                lambda: utimensat(p, "omit", "omit"))
    user_expect(errno.EACCES, "utimensat(UTIME_NOW, UTIME_NOW) on root's 0644 file",
                lambda: utimensat(p, "now", "now"))
    eq(os.stat(p).st_mtime_ns, OLD_NS, "mtime after the refused and the empty change")
    os.chmod(p, 0o646)
    user_expect(0, "utimensat(UTIME_NOW, UTIME_NOW) with write permission",
                lambda: utimensat(p, "now", "now"))
    ok(os.stat(p).st_mtime_ns > OLD_NS, "mtime set to now by a writer")


@check("path_max_enametoolong")
def _(d):
    long_path = J(d, *(["a" * 200] * 25))  # over 4096 bytes
    expect_errno(errno.ENAMETOOLONG, "open of a path over PATH_MAX", os.open, long_path, os.O_RDONLY)
    expect_errno(errno.ENAMETOOLONG, "mkdir of a 256-byte name", os.mkdir, J(d, "d" * 256))
    os.mkdir(J(d, "d" * 255))


# ==========================================================================
# runner


def _probe_user(work: str) -> None:
    try:
        kind, v = as_user(lambda: os.listdir(work) and None)
    except Fail as e:
        State.user_ok, State.user_reason = False, f"uid 1000 probe failed: {e}"
        return
    if kind == "errno":
        State.user_ok = False
        State.user_reason = (f"uid 1000 cannot list {work} ({ename(v)}): permission checks need "
                             f"search permission on every parent and, on FUSE, allow_other")


def _where(tb) -> str:
    """Where in this file a check stopped: the innermost check line, not a helper's."""
    helpers = {"ok", "eq", "expect_errno", "user_expect", "user_ok", "as_user", "_run_child",
               "renameat2", "utimensat", "getxattr_raw", "getdents", "_cerr", "wfile", "rfile",
               "writeall", "readall", "_open_close", "_mkfiles", "_map", "hard_link", "sym_link"}
    frames = [f for f in traceback.extract_tb(tb) if f.filename == __file__]
    inner = [f for f in frames if f.name not in helpers] or frames
    if not inner:
        return ""
    f = inner[-1]
    return f" [line {f.lineno}: {f.line.strip()}]" if f.line else f" [line {f.lineno}]"


def _on_alarm(signum, frame):
    raise Timeout()


def _cleanup(path: str) -> None:
    def onerror(fn, p, exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError:
            pass
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=onerror)
    else:
        shutil.rmtree(path, onerror=onerror)


def run_one(c: Check, d: str, timeout: float) -> tuple[str, str]:
    if c.links and State.skip_links:
        return "SKIP", "--skip-links"
    os.mkdir(d, 0o755)
    os.chmod(d, 0o755)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        c.fn(d)
        return "PASS", ""
    except Skip as e:
        return "SKIP", str(e)
    except Fail as e:
        return "FAIL", str(e) + _where(e.__traceback__)
    except Timeout:
        return "FAIL", f"timed out after {timeout:.0f} s"
    except OSError as e:
        return "FAIL", f"unexpected {ename(e.errno)}: {e}{_where(e.__traceback__)}"
    except Exception as e:  # noqa: BLE001 - a broken check is a failure too
        return "FAIL", f"{type(e).__name__}: {e}{_where(e.__traceback__)}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            _cleanup(d)
        except OSError:
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="POSIX file-system conformance checks")
    ap.add_argument("dir", help="directory on the file system under test")
    ap.add_argument("--skip-links", action="store_true", help="report hard/symbolic link checks as SKIP")
    ap.add_argument("--json", action="store_true",
                    help="write a JSON report to stdout (the text lines go to stderr)")
    ap.add_argument("-k", "--only", action="append", default=[], metavar="PATTERN",
                    help="run only checks whose name matches this glob or substring (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the checks and exit")
    ap.add_argument("--timeout", type=float, default=CHECK_TIMEOUT, help="seconds allowed per check")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)

    checks = CHECKS
    if args.only:
        checks = [c for c in CHECKS
                  if any(fnmatch.fnmatch(c.name, pat) or pat in c.name for pat in args.only)]
    if args.list:
        for c in checks:
            print(f"{c.area:12} {c.name}{'  (links)' if c.links else ''}")
        return 0
    if os.geteuid() != 0:
        print("conformance.py must run as root (permission checks switch to uid 1000)", file=sys.stderr)
        return 2
    if not os.path.isdir(args.dir):
        print(f"{args.dir}: not a directory", file=sys.stderr)
        return 2

    State.skip_links = args.skip_links
    os.umask(0)
    signal.signal(signal.SIGALRM, _on_alarm)
    out = sys.stderr if args.json else sys.stdout
    work = os.path.join(os.path.abspath(args.dir), f"posix-conformance.{os.getpid()}")
    os.mkdir(work, 0o755)
    os.chown(work, 0, 0)
    os.chmod(work, 0o755)
    _probe_user(work)

    results = []
    counts = Counter()
    t_start = time.monotonic()
    try:
        for i, c in enumerate(checks):
            t0 = time.monotonic()
            status, why = run_one(c, os.path.join(work, f"{i:03d}-{c.name}"), args.timeout)
            dt = time.monotonic() - t0
            counts[status] += 1
            results.append({"name": c.name, "area": c.area, "status": status,
                            "reason": why, "seconds": round(dt, 3)})
            print(f"{status} {c.name}" + (f": {why}" if why else ""), file=out, flush=True)
    finally:
        if not args.keep:
            _cleanup(work)
            if os.path.lexists(work):
                print(f"warning: could not remove {work}", file=sys.stderr)
    summary = f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
    if args.json:
        print(summary, file=out, flush=True)
        json.dump({"dir": os.path.abspath(args.dir), "passed": counts["PASS"], "failed": counts["FAIL"],
                   "skipped": counts["SKIP"], "seconds": round(time.monotonic() - t_start, 3),
                   "results": results}, sys.stdout, indent=1)
        print()
    else:
        print(summary, flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
