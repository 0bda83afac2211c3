"""Folders that instances of a device share: the start-up lock folder and
the budget ledgers in it. One rule for both, in one place.

Whoever may rename or remove a folder's entries can defeat a lock kept in
it (swap the lock file, drop an instance's ledger entry). Besides root and
the folder's owner, that is anyone who may write to the folder, unless the
sticky bit limits each user to their own entries. So a folder is accepted
when:

- others may not write to it, or it is sticky (like ``/tmp``: mode 1777);
- its group may not write to it, or it is sticky, or it is a group's folder
  (set-group-ID, mode 2770): the members of that group trust each other,
  and nobody else may even enter it. This restricts a lock folder or a
  budget to one group.

A folder is opened without following a link (``O_NOFOLLOW | O_DIRECTORY``),
and its mode is read from the opened descriptor, so it cannot change between
the check and the use; a file in it is opened relative to it, without
following a link, and only used when it is a regular file
(:func:`open_regular`). No vLLM import here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

SHARED_MODE = 0o1777
"""The mode of a folder this package creates: every user of the device may
add entries, and only remove their own (like ``/tmp``)."""


class LockSetupError(OSError):
    """A shared folder or a file in it is not what it must be (a symbolic
    link, a folder others may rename entries in)."""


def unsafe_mode_reason(mode: int) -> str | None:
    """Why a folder of ``mode`` lets others rename its entries, or None when
    it does not (see the module docstring)."""
    if mode & stat.S_ISVTX:
        return None
    if mode & stat.S_IWOTH:
        return "writable by others without the sticky bit"
    if mode & stat.S_IWGRP and not mode & stat.S_ISGID:
        return "writable by its group without the sticky or the set-group-ID bit"
    return None


def open_folder(name: str, shown: str, what: str, advice: str, dir_fd: int | None = None) -> int:
    """Open the shared folder ``name`` (relative to ``dir_fd`` when given),
    creating it with :data:`SHARED_MODE` if missing, and return its
    descriptor. Raise :class:`LockSetupError` naming it as ``what``
    ``shown``, with ``advice`` on what would work, when it is a link or a
    file, or a folder whose entries others may rename."""
    try:
        os.mkdir(name, 0o777, dir_fd=dir_fd)
    except FileExistsError:
        pass
    else:
        with contextlib.suppress(OSError):
            os.chmod(name, SHARED_MODE, dir_fd=dir_fd)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise LockSetupError(
                f"the {what} {shown} is not a plain folder (a symbolic link or a file); {advice}"
            ) from None
        raise
    mode = os.fstat(fd).st_mode
    reason = unsafe_mode_reason(mode)
    if reason is not None:
        os.close(fd)
        raise LockSetupError(
            f"the {what} {shown} is {reason} (mode {stat.S_IMODE(mode):o}): anyone who may write "
            f"to it could rename or remove the instances' files. Make it sticky (chmod +t {shown}), "
            f"restrict it to one group (chgrp GROUP {shown}; chmod 2770 {shown}), or {advice}"
        )
    return fd


def open_regular(dir_fd: int, name: str, flags: int, mode: int = 0o644) -> int | None:
    """Open ``name`` in the folder ``dir_fd`` without following a link (nor
    blocking on a FIFO); None when it is not a regular file (or is gone).

    With ``O_CREAT``, a file this user owns gets ``mode`` whatever the
    umask: under a umask of 077 it would be created ``0600``, and other
    users' instances could neither read the entry nor lock the lock file.
    The one place the modes of the files in shared folders are set."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOENT, errno.ENXIO, errno.EISDIR):
            return None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        return None
    if flags & os.O_CREAT and info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != mode:
        try:
            os.fchmod(fd, mode)
        except OSError:
            os.close(fd)
            raise
    return fd


def lock_holders(fd: int) -> str | None:
    """Who holds a lock on the file open on ``fd``, as ``/proc/locks`` shows
    it (the pids and their command lines), for an error that names them;
    None when it shows nobody this process can see (a holder in another
    PID namespace shows as pid 0, or not at all). Best effort."""
    info = os.fstat(fd)
    where = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    pids: list[int] = []
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            for line in locks:
                fields = line.split()
                if len(fields) > 5 and fields[1] != "->" and fields[5] == where and fields[4].isdigit():
                    pid = int(fields[4])
                    if pid > 0 and pid not in pids:
                        pids.append(pid)
    except OSError:
        return None
    return ", ".join(f"pid {pid} ({_command(pid)})" for pid in pids) or None


def _command(pid: int) -> str:
    """The command line of ``pid``, printable and short (it is another user's text)."""
    if pid == os.getpid():
        return "this process"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            raw = cmdline.read(4096)
    except OSError:
        return "command line not readable"
    text = "".join(c if c.isprintable() else " " for c in raw.replace(b"\0", b" ").decode("utf-8", "replace")).strip()
    return (text[:200] + "...") if len(text) > 200 else (text or "no command line")
