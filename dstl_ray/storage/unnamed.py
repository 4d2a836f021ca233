"""Unnamed files (Linux ``O_TMPFILE``): write a file's bytes, fsync them, then give it its name.

:class:`~dstl_ray.storage.local.LocalStorage` writes a new file as an inode without a name in
its directory and links it under its name only once the data is durable. That is as durable
and as atomic as the classic temp file + fsync + rename, but no temporary name ever exists:
no directory listing (orphan cleanup, a file-counting experiment) sees ``*.tmp-*`` files, and
a writer killed mid-write leaves nothing behind, as the kernel frees an unlinked inode with
its last descriptor.

Linking an unnamed inode takes ``linkat(fd, "", AT_FDCWD, name, AT_EMPTY_PATH)`` (allowed to
root, and since Linux 6.10 to the process that opened the file) or ``linkat`` of its
``/proc/self/fd/N`` name with ``AT_SYMLINK_FOLLOW`` (the way open(2) documents; some kernels
refuse it with EXDEV). Each way that fails for want of support is dropped for the rest of the
process; when none is left, or the file system cannot make unnamed files, :func:`open_unnamed`
returns None and the caller writes a named temp file as before.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable

_O_TMPFILE: int | None = getattr(os, "O_TMPFILE", None)
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
# open(O_TMPFILE) where the kernel or file system has no unnamed files
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)
# a way of linking that this kernel refuses (no capability, no /proc, a hardened /proc)
_CANNOT_LINK = (errno.ENOENT, errno.EXDEV, errno.EPERM, errno.EINVAL, errno.EOPNOTSUPP,
                errno.ENOSYS)


def _libc_linkat() -> Callable[..., int] | None:
    try:
        f = ctypes.CDLL(None, use_errno=True).linkat
    except (OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
    f.restype = ctypes.c_int
    return f


_linkat = _libc_linkat()


def _link_empty_path(fd: int, name: str) -> None:
    assert _linkat is not None
    if _linkat(fd, b"", _AT_FDCWD, os.fsencode(name), _AT_EMPTY_PATH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), name)


def _link_proc(fd: int, name: str) -> None:
    os.link(f"/proc/self/fd/{fd}", name, follow_symlinks=True)


# the ways of linking still believed to work here, best first
_ways: list[Callable[[int, str], None]] = [
    w for w, ok in ((_link_empty_path, _linkat is not None),
                    (_link_proc, os.path.isdir("/proc/self/fd"))) if ok]
_ways_lock = threading.Lock()


def available() -> bool:
    """Whether this process can still make and name unnamed files at all."""
    return _O_TMPFILE is not None and bool(_ways)


def open_unnamed(directory: str) -> int | None:
    """A descriptor of a new, unnamed regular file in ``directory`` (freed on close unless
    linked), or None where this system or file system cannot make or name one."""
    if not available():
        return None
    assert _O_TMPFILE is not None
    try:
        return os.open(directory, _O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno in _NO_TMPFILE:
            return None
        raise


def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd`` (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def link_unnamed(fd: int, name: str) -> bool:
    """Give the unnamed file ``fd`` the name ``name``: True when linked, False when no way
    of linking works on this system (nothing was named; the caller writes a named file).
    Raises FileExistsError if ``name`` exists, OSError on any other failure."""
    for way in list(_ways):
        try:
            way(fd, name)
            return True
        except FileExistsError:
            raise
        except OSError as e:
            if e.errno not in _CANNOT_LINK:
                raise
            if e.errno == errno.ENOENT and not os.path.isdir(os.path.dirname(name) or "."):
                raise  # the directory is gone: a real error, not a missing capability
            with _ways_lock:
                if way in _ways:
                    _ways.remove(way)
    return False
