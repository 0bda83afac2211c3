"""Announcements: every instance started with a cap says, in the lock folder,
that it is there, so that ``vllm-kv-top`` can list them.

Each instance's entry is a file in ``instances/`` of the start-up lock
folder (``startup_lock.lock_dir``), with the ledger's rules
(``budget_ledger``): the folder passes the shared folders' rule
(``shared_folder.open_folder``), every file is opened relative to it
without following a link and used only when it is a regular file
(``shared_folder.open_regular``), and the instance holds an ``flock`` on
its entry for as long as it lives. The kernel drops that lock when the
process dies, however it dies: a reader that can lock an entry knows its
owner is gone and does not list it, so nothing needs cleaning up after a
crash (an instance that announces itself removes the dead entries it may).
No pid is compared, so a reused pid never revives an entry.

An entry is written under a hidden name, locked, then renamed into place:
a reader never sees an entry its owner does not hold yet. No vLLM import
here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from vllm_kv_cache_limit.logic.shared_folder import LockSetupError, open_folder, open_regular
from vllm_kv_cache_limit.logic.startup_lock import LOCK_DIR_ADVICE, open_lock_folder

FOLDER = "instances"
"""The announcements' folder, in the lock folder."""
SUFFIX = ".entry"
RECORD_BYTES = 8192
VERSION = 1
FIELDS: dict[str, tuple[type, ...]] = {
    "version": (int,),
    "host": (str,),
    "pid": (int,),
    "container": (str, type(None)),
    "model": (str,),
    "cap": (int, type(None)),
    "floor": (int, type(None)),
    "autoscale": (bool,),
    "budget": (int, type(None)),
    "devices": (list,),
    "status_url": (str, type(None)),
    "started": (float, int),
}
"""Every field of an entry and the types it may have."""


def in_container() -> bool:
    """Whether this process runs in a container (Docker, Podman, Kubernetes)."""
    return (
        os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv") or "KUBERNETES_SERVICE_HOST" in os.environ
    )


def record(
    devices: list[tuple[str, str]],
    model: str,
    cap: int | None,
    floor: int | None = None,
    autoscale: bool = False,
    budget: int | None = None,
    status_url: str | None = None,
) -> dict[str, Any]:
    """This process's entry: its label (host, pid, the container's host
    name when in one), its ``(key, label)`` devices, model, cap and floor
    (bytes per worker), its shared budget (bytes per device) and where its
    status can be read."""
    host = socket.gethostname()
    return {
        "version": VERSION,
        "host": host,
        "pid": os.getpid(),
        "container": host if in_container() else None,
        "model": model,
        "cap": cap,
        "floor": floor,
        "autoscale": autoscale,
        "budget": budget,
        "devices": [{"key": key, "label": label} for key, label in devices],
        "status_url": status_url,
        "started": round(time.time(), 3),
    }


def parse(data: bytes) -> dict[str, Any]:
    """An entry's record from its bytes; ``ValueError`` saying what is wrong."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    if value.get("version") != VERSION:
        raise ValueError(f"version {value.get('version')!r}, expected {VERSION}")
    for name, types in FIELDS.items():
        if name not in value:
            raise ValueError(f"no {name!r} field")
        if not isinstance(value[name], types) or (isinstance(value[name], bool) and bool not in types):
            raise ValueError(f"field {name!r} is {value[name]!r}")
    for device in value["devices"]:
        if not (
            isinstance(device, dict) and isinstance(device.get("key"), str) and isinstance(device.get("label"), str)
        ):
            raise ValueError(f"device {device!r} is not {{'key': ..., 'label': ...}}")
    return value


def label(entry: dict[str, Any]) -> str:
    """How people name an announced instance: host (the container's, in one) and pid."""
    return f"{entry['host']} pid {entry['pid']}"


def _write(fd: int, entry: dict[str, Any]) -> None:
    """Write the entry in one ``pwrite``, padded with spaces (which JSON
    ignores) to the file's length: a reader never sees the end of an older,
    longer record."""
    data = json.dumps(entry, sort_keys=True).encode()
    if len(data) > RECORD_BYTES:
        raise ValueError(f"announcement of {len(data)} bytes is over {RECORD_BYTES}")
    os.pwrite(fd, data.ljust(os.fstat(fd).st_size, b" "), 0)


class Announcement:
    """One instance's entry in the lock folder, held (locked) while it lives."""

    def __init__(self, folder: str, entry: dict[str, Any]) -> None:
        self.path = os.path.join(folder, FOLDER)
        top = open_lock_folder(folder)
        try:
            self.dir_fd = open_folder(FOLDER, self.path, "instances folder", LOCK_DIR_ADVICE, dir_fd=top)
        finally:
            os.close(top)
        token = secrets.token_hex(8)
        hidden, self.name = f".{token}.new", f"{token}{SUFFIX}"
        try:
            fd = open_regular(self.dir_fd, hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            if fd is None:
                raise LockSetupError(f"the announcement {os.path.join(self.path, hidden)} is not a file")
        except OSError:
            os.close(self.dir_fd)
            raise
        self.fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write(fd, entry)
            os.rename(hidden, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(hidden, dir_fd=self.dir_fd)
            self.close()
            raise
        self.entry = dict(entry)
        prune(self.dir_fd)

    def update(self, **fields: Any) -> None:
        """Change fields of the entry (``status_url`` once the server listens)."""
        if self.fd < 0:
            return
        self.entry.update(fields)
        _write(self.fd, self.entry)

    def close(self) -> None:
        """Remove the entry (a clean exit); a crash leaves it unlocked, which readers skip."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.name, dir_fd=self.dir_fd)
            os.close(self.fd)
            self.fd = -1
        if self.dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.dir_fd)
            self.dir_fd = -1


def alive(fd: int) -> bool:
    """Whether a live process holds the entry open on ``fd`` locked: a shared
    lock is refused while its owner's exclusive one stands."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def prune(dir_fd: int) -> None:
    """Remove the entries no live process holds, where this user may."""
    for name in os.listdir(dir_fd):
        if not name.endswith(SUFFIX):
            continue
        with contextlib.suppress(OSError):
            fd = open_regular(dir_fd, name, os.O_RDONLY)
            if fd is None:
                continue
            try:
                if not alive(fd):
                    os.unlink(name, dir_fd=dir_fd)
            finally:
                os.close(fd)


@dataclass
class Entry:
    """One file of the announcements' folder as a reader found it: the
    record of a live instance, or a problem with the file (never both);
    ``owner``, the uid owning the file read (``vllm-kv-top`` sends its key
    only to this user's entries)."""

    name: str
    record: dict[str, Any] | None = None
    problem: str | None = None
    owner: int | None = None


class FolderMissing(Exception):
    """The lock folder is not there (no capped instance ever ran with it)."""


def read(folder: str) -> list[Entry]:
    """The live instances announced in the lock folder ``folder``, and a
    problem for each file that cannot be read or is no entry; dead entries
    are left out. Raises :class:`FolderMissing` when ``folder`` does not
    exist, ``OSError`` when it cannot be read. Creates nothing."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        top = os.open(folder, flags)
    except FileNotFoundError:
        raise FolderMissing(folder) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OSError(exc.errno, "not a plain folder (a symbolic link or a file)") from None
        raise
    try:
        try:
            dir_fd = os.open(FOLDER, flags, dir_fd=top)
        except FileNotFoundError:
            return []
    finally:
        os.close(top)
    try:
        return [entry for name in sorted(os.listdir(dir_fd)) if (entry := _read_one(dir_fd, name)) is not None]
    finally:
        os.close(dir_fd)


def _read_one(dir_fd: int, name: str) -> Entry | None:
    if name.startswith(".") or not name.endswith(SUFFIX):
        return None
    try:
        fd = open_regular(dir_fd, name, os.O_RDONLY)
    except OSError as exc:
        return Entry(name, problem=f"cannot be read ({exc.strerror or exc}); ask its owner, or remove it")
    if fd is None:
        return Entry(name, problem="is not a regular file (a link, a folder or a device); remove it")
    try:
        try:
            data = os.pread(fd, RECORD_BYTES + 1, 0)
        except OSError as exc:
            return Entry(name, problem=f"cannot be read ({exc.strerror or exc}); ask its owner, or remove it")
        try:
            entry = parse(data)
        except ValueError as exc:
            shown = data[:60].decode("utf-8", "replace")
            return Entry(name, problem=f"is no instance entry ({exc}; starts {shown!r}); remove it")
        return Entry(name, record=entry, owner=os.fstat(fd).st_uid) if alive(fd) else None
    finally:
        os.close(fd)
