"""Files that no other user of the host can plant, swap or read.

Every file ronde makes outside the user's own folders lives in one directory per
user, :func:`private_dir`:

* ``$XDG_RUNTIME_DIR/ronde`` where ``XDG_RUNTIME_DIR`` is set, owned by this user and
  mode ``0700`` (a login session's ``/run/user/UID``);
* else ``<tempdir>/ronde-<uid>`` (``TMPDIR``, else ``/tmp``).

Another user of a shared ``/tmp`` can make that name first (a directory of theirs, a
``0777`` one, a symbolic link), so it is made with ``mkdir`` mode ``0700`` and then
checked with ``lstat``: owned by this uid, mode exactly ``0700``, a directory and not
a link. Anything else raises :class:`~ronde.SecurityError` naming the path and the fix.

Inside it, :func:`create_file` makes files with ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode
``0600``, under random names, and :func:`open_checked` opens with ``O_NOFOLLOW`` and
``fstat`` s what it opened (owned by this uid, a regular file, no permission for group or
others) before one byte is trusted. :func:`check_own_file` is that check alone, for
files that must live in a shared place (the shared-memory segments in ``/dev/shm``:
``transport/segments.py``).

None of this relies on the kernel's ``fs.protected_regular`` or
``fs.protected_symlinks``, which many hosts (containers, older distributions) do not set.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import tempfile

from ._errors import SecurityError

log = logging.getLogger(__name__)

_FIX_DIR = ("remove it (as its owner or root) if nobody should have made it there, or "
            "point ronde elsewhere: set XDG_RUNTIME_DIR to a directory of yours with mode "
            "0700, or TMPDIR to a folder of yours")
_FIX_FILE = ("Another user may have planted it: remove it (as its owner or root) and start "
             "the job again, or point ronde elsewhere (TMPDIR, XDG_RUNTIME_DIR)")


def private_dir() -> str:
    """This user's private directory for ronde's files, made on first use.

    Raises:
        SecurityError: the path exists but is not this user's ``0700`` directory.
    """
    base = _runtime_dir()
    path = os.path.join(base, "ronde") if base else \
        os.path.join(tempfile.gettempdir(), f"ronde-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    else:
        _restore_mode(path)
    _check_dir(path)
    return path


def _runtime_dir() -> str | None:
    """``XDG_RUNTIME_DIR`` where it is this user's ``0700`` directory, else None."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.path.isabs(base):
        return None
    try:
        st = os.lstat(base)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and \
            stat.S_IMODE(st.st_mode) == 0o700:
        return base
    log.debug("ronde: XDG_RUNTIME_DIR=%s is not this user's 0700 directory; using %s",
              base, tempfile.gettempdir())
    return None


def _restore_mode(path: str) -> None:
    """0700 on the directory just made, where a umask took bits away (0700 & ~umask);
    through a descriptor of that directory, never a link put in its place."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # no longer the directory just made: _check_dir says what it is
    try:
        st = os.fstat(fd)
        if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _check_dir(path: str) -> None:
    st = os.lstat(path)
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        wrong = "is a symbolic link, not a directory"
    elif not stat.S_ISDIR(st.st_mode):
        wrong = "is not a directory"
    elif st.st_uid != uid:
        wrong = f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    elif stat.S_IMODE(st.st_mode) != 0o700:
        wrong = (f"has mode {stat.S_IMODE(st.st_mode):04o}, not 0700 (other users may "
                 "read or plant files there)")
    else:
        return
    raise SecurityError(f"ronde's private directory {path} {wrong}: {_FIX_DIR}")


def create_file(directory: str, prefix: str, suffix: str = "") -> tuple[int, str]:
    """A new file in ``directory`` under a random name, mode ``0600``, open for writing;
    never an existing file or a link (``O_EXCL|O_NOFOLLOW``). Returns (fd, path)."""
    while True:
        path = os.path.join(directory, f"{prefix}{secrets.token_hex(8)}{suffix}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue  # 64 random bits taken already: draw again
        return fd, path


def open_checked(path: str, flags: int = os.O_RDONLY) -> int:
    """Open ``path`` (not following a link, not blocking on a FIFO) and check what was
    opened before anything is read from it (:func:`check_own_file`); returns the fd.

    Raises:
        FileNotFoundError: nothing is there (yet).
        SecurityError: a link, another user's file, a file others may write, not a
            regular file.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SecurityError(f"{path} is a symbolic link, where ronde expects its own "
                                f"file. {_FIX_FILE}") from None
        raise
    try:
        check_own_file(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_own_file(st: os.stat_result, path: str) -> None:
    """Raise :class:`SecurityError` unless ``st`` (an ``fstat`` of the opened file) is a
    regular file of this user that no group or other user may read or write."""
    uid = os.getuid()
    if not stat.S_ISREG(st.st_mode):
        wrong = "is not a regular file"
    elif st.st_uid != uid:
        wrong = f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    elif st.st_mode & 0o077:
        wrong = f"has mode {stat.S_IMODE(st.st_mode):04o}; ronde's files are 0600"
    else:
        return
    raise SecurityError(f"{path} {wrong}: ronde does not trust it. {_FIX_FILE}")
