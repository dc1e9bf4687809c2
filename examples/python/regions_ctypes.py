"""A ctypes binding of libregions' C ABI (libregions/include/regions.h).

Copy this file next to your program; it needs only the Python standard
library and an installed libregions.so:

    scripts/install-libregions.sh /usr/local     # or any PREFIX

The library is found through $REGIONS_LIB (a path to libregions.so), else
ctypes.util.find_library("regions") (the ld.so cache, so PREFIX/lib must be
known to ldconfig or listed in LD_LIBRARY_PATH).

Every call raises OSError (with .errno set) when the C call fails; set
REGIONS_DEBUG=1 to have the library print what failed to stderr. The sync
calls (barriers, mutexes, doorbells) and rsetdefaultattr talk to the host
agent of the mount named by $REGIONS_MOUNT (default /regions); the mapping
and allocation calls use the mount of the file descriptor they are given.

    import os, regions_ctypes as rc
    lib = rc.load()
    with rc.Region(lib, "/regions/data", size=1 << 20) as r:
        r.buffer[:5] = b"hello"        # a writable memoryview of the mapping
        r.msync()                      # write back now (close does it too)

Addresses are plain Python ints (C void *). Read and write them with
ctypes.string_at / ctypes.memmove, or view a whole mapping with Region.buffer.
"""

import ctypes
import ctypes.util
import os

__all__ = [
    "LIB_ENV",
    "MS_ASYNC",
    "MS_INVALIDATE",
    "MS_SYNC",
    "RATTR_FIXVADDR",
    "RATTR_HOSTALLOC",
    "RATTR_MULTIHOSTED",
    "RATTR_ONEWRITER",
    "RATTR_PERSISTENT",
    "Libregions",
    "Region",
    "load",
]

LIB_ENV = "REGIONS_LIB"

# Region attributes for rsetdefaultattr (regions.h RATTR_*).
RATTR_PERSISTENT = 1
RATTR_MULTIHOSTED = 2
RATTR_FIXVADDR = 3
RATTR_ONEWRITER = 4
RATTR_HOSTALLOC = 5

# msync(2) flags for rmsync (Linux values).
MS_ASYNC = 1
MS_INVALIDATE = 2
MS_SYNC = 4

_c_int = ctypes.c_int
_c_long = ctypes.c_long
_c_size = ctypes.c_size_t
_c_bool = ctypes.c_bool
_c_ptr = ctypes.c_void_p
_c_str = ctypes.c_char_p

# name: (restype, argtypes), exactly as declared in regions.h.
_PROTOTYPES = {
    # mapping
    "rmap": (_c_ptr, [_c_int]),
    "runmap": (_c_int, [_c_ptr]),
    "rprefetch": (_c_int, [_c_ptr, _c_size, _c_bool]),
    "rmarkdirty": (_c_int, [_c_ptr, _c_size, _c_bool]),
    "rclearcache": (_c_int, [_c_ptr, _c_size]),
    "rmsync": (_c_int, [_c_ptr, _c_size, _c_int]),
    # allocation
    "rmalloc": (_c_ptr, [_c_int, _c_size]),
    "rfree": (_c_int, [_c_ptr]),
    "rsetroot": (_c_int, [_c_int, _c_ptr]),
    "rgetroot": (_c_ptr, [_c_int]),
    "rsetdefaultattr": (_c_int, [_c_int, _c_str, _c_int]),
    # sync
    "rbarrier_init": (_c_int, [_c_str, _c_int]),
    "rbarrier_wait": (_c_int, [_c_str]),
    "rmutex_init": (_c_int, [_c_str]),
    "rmutex_lock": (_c_int, [_c_str]),
    "rmutex_unlock": (_c_int, [_c_str]),
    "rbell_init": (_c_int, [_c_str]),
    "rbell_ring": (_c_int, [_c_str]),
    "rbell_wait": (_c_long, [_c_str]),
    "rdelete": (_c_int, [_c_str]),
}


def _fail(call):
    err = ctypes.get_errno()
    return OSError(err, f"libregions {call} failed: {os.strerror(err)}")


def _name(name):
    if isinstance(name, str):
        name = name.encode()
    if not isinstance(name, bytes) or b"\0" in name:
        raise ValueError(f"a sync object name must be str or bytes without NUL: {name!r}")
    return name


class Libregions:
    """The loaded library: one method per C call, raising OSError on failure.

    The raw functions stay reachable as `lib.cdll.rmap` etc. (with argtypes
    and restype set) for callers that want C's return convention.
    """

    def __init__(self, path):
        # use_errno: ctypes saves the C errno of each call for get_errno().
        self.cdll = ctypes.CDLL(path, use_errno=True)
        self.path = path
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(self.cdll, name)
            fn.restype = restype
            fn.argtypes = argtypes

    def _int(self, call, *args):
        ctypes.set_errno(0)
        ret = getattr(self.cdll, call)(*args)
        if ret == -1:
            raise _fail(call)
        return ret

    def _ptr(self, call, *args):
        ctypes.set_errno(0)
        ret = getattr(self.cdll, call)(*args)
        if ret is None:  # c_void_p turns NULL into None
            raise _fail(call)
        return ret

    # mapping

    def rmap(self, fd):
        """Maps the whole region open as `fd` (at its fixed address if
        FIXVADDR); returns the address. Mapping twice gives the same one."""
        return self._ptr("rmap", fd)

    def runmap(self, addr):
        """Unmaps the mapping containing `addr` (dirty pages written back)."""
        self._int("runmap", addr)

    def rprefetch(self, addr, length, sync=True):
        """Fetches [addr, addr+length) into this host's cache."""
        self._int("rprefetch", addr, length, sync)

    def rmarkdirty(self, addr, length, zero=False):
        """Marks [addr, addr+length) dirty; with zero, it becomes zeros unfetched."""
        self._int("rmarkdirty", addr, length, zero)

    def rclearcache(self, addr, length):
        """Drops this host's copy of [addr, addr+length); the next access fetches."""
        self._int("rclearcache", addr, length)

    def rmsync(self, addr, length, flags=MS_SYNC):
        """Writes the dirty pages of [addr, addr+length) back to the region."""
        self._int("rmsync", addr, length, flags)

    # allocation

    def rmalloc(self, fd, length):
        """Allocates `length` bytes inside the region (16-byte aligned)."""
        return self._ptr("rmalloc", fd, length)

    def rfree(self, addr):
        """Frees a block returned by rmalloc (in any process mapping the region)."""
        self._int("rfree", addr)

    def rsetroot(self, fd, addr):
        """Stores `addr` (None clears it) as the region's root pointer."""
        self._int("rsetroot", fd, addr)

    def rgetroot(self, fd):
        """The region's root pointer in this process's mapping, or None."""
        ctypes.set_errno(0)
        ret = self.cdll.rgetroot(fd)
        if ret is None:
            if ctypes.get_errno() != 0:
                raise _fail("rgetroot")
            return None
        return ret

    def rsetdefaultattr(self, attr, value):
        """Sets (value: str or bytes) or clears (value None) a default
        attribute (RATTR_*) of the regions this thread creates afterwards."""
        if value is None:
            self._int("rsetdefaultattr", attr, None, 0)
            return
        if isinstance(value, str):
            value = value.encode()
        self._int("rsetdefaultattr", attr, value, len(value))

    # sync

    def barrier_init(self, name, n):
        self._int("rbarrier_init", _name(name), n)

    def barrier_wait(self, name):
        self._int("rbarrier_wait", _name(name))

    def mutex_init(self, name):
        self._int("rmutex_init", _name(name))

    def mutex_lock(self, name):
        self._int("rmutex_lock", _name(name))

    def mutex_unlock(self, name):
        self._int("rmutex_unlock", _name(name))

    def mutex(self, name):
        """`with lib.mutex("name"):` holds the named mutex (created if needed)."""
        return _Held(self, _name(name))

    def bell_init(self, name):
        self._int("rbell_init", _name(name))

    def bell_ring(self, name):
        self._int("rbell_ring", _name(name))

    def bell_wait(self, name):
        """Waits for a ring since this process's last wait; returns the ring count."""
        return self._int("rbell_wait", _name(name))

    def delete(self, name):
        self._int("rdelete", _name(name))


class _Held:
    def __init__(self, lib, name):
        self.lib, self.name = lib, name

    def __enter__(self):
        self.lib.mutex_init(self.name)
        self.lib.mutex_lock(self.name)
        return self

    def __exit__(self, *exc):
        self.lib.mutex_unlock(self.name)
        return False


def load(path=None):
    """Loads libregions from `path`, $REGIONS_LIB or the system's library path."""
    path = path or os.environ.get(LIB_ENV) or ctypes.util.find_library("regions")
    if not path:
        raise OSError(
            "libregions not found: install it (scripts/install-libregions.sh PREFIX, then "
            f"ldconfig PREFIX/lib) or set {LIB_ENV}=PREFIX/lib/libregions.so"
        )
    try:
        return Libregions(path)
    except OSError as e:
        raise OSError(f"cannot load libregions from {path}: {e} (set {LIB_ENV} to libregions.so)") from e


class Region:
    """A region file opened and mapped with rmap: `addr`, `size`, `buffer`
    (a writable memoryview of the whole mapping; read-only when opened
    read-only). Closing rmsyncs (when writable), runmaps and closes the file;
    views taken from `buffer` must not be used after that (the memory is gone).

    size: when given and larger than the file, the region is grown to it
    first (ftruncate). create: O_CREAT (the region is created through the
    mount with this thread's default attributes, see rsetdefaultattr).
    """

    def __init__(self, lib, path, size=None, write=True, create=True):
        self.lib = lib
        flags = os.O_RDWR if write else os.O_RDONLY
        if create and write:
            flags |= os.O_CREAT
        self.fd = os.open(path, flags, 0o644)
        self.write = write
        self.addr = None
        try:
            if size is not None and write and os.fstat(self.fd).st_size < size:
                os.ftruncate(self.fd, size)
            self.size = os.fstat(self.fd).st_size
            if self.size == 0:
                raise OSError(f"{path} is empty: give a size to map it")
            self.addr = lib.rmap(self.fd)
            array = (ctypes.c_char * self.size).from_address(self.addr)
            view = memoryview(array).cast("B")
            self.buffer = view if write else view.toreadonly()
        except BaseException:
            os.close(self.fd)
            raise

    def msync(self, offset=0, length=None):
        """Writes the dirty pages of [offset, offset+length) back."""
        length = self.size - offset if length is None else length
        self.lib.rmsync(self.addr + offset, length, MS_SYNC)

    def close(self):
        if self.addr is None:
            return
        try:
            if self.write:
                self.msync()
        finally:
            self.buffer.release()
            addr, self.addr = self.addr, None
            try:
                self.lib.runmap(addr)
            finally:
                os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
