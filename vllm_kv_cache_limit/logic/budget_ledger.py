"""The ledger of a device's shared KV cache budget: one file per instance.

Instances started with the same ``--kv-cache-shared-budget`` for a device
write what they hold and wish for into ``budget-<device key>/`` in the
start-up lock folder (``startup_lock.lock_dir``). Each instance's entry is
a file it created (``O_EXCL``) and holds an ``flock`` on for as long as its
engine core lives; the kernel drops that lock when the process dies, however
it dies, so a reader that can lock an entry knows its owner is gone and
ignores it (and removes it where it may). No pid is ever compared, so a
reused pid cannot keep a dead share alive, also across containers (``flock``
works on the shared file, whatever the PID namespace). Every read and write
of the ledger happens under the folder's ``ledger.lock``, so an instance
always sees the others' entries whole, and a grow is checked against all
of them at once.

Files are opened relative to the folder without following links
(``O_NOFOLLOW``); the folder itself must pass the shared folders' rule
(``shared_folder``): a plain directory, sticky when others may write to it,
or a group's folder (mode 2770) that restricts the budget to that group.
No vLLM import here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm_kv_cache_limit.logic.shared_folder import LockSetupError, open_folder, open_regular
from vllm_kv_cache_limit.logic.startup_lock import LOCK_DIR_ADVICE, holder_label, lock_name, open_lock_folder

LEDGER_LOCK = "ledger.lock"
ENTRY_SUFFIX = ".entry"
RECORD_BYTES = 4096


def folder_name(key: str) -> str:
    """The ledger folder of a device key such as ``cpu-node0``."""
    return "budget-" + lock_name(key).removesuffix(".lock")


def _write(fd: int, record: dict[str, Any]) -> None:
    data = json.dumps(record, sort_keys=True).encode()
    if len(data) > RECORD_BYTES:
        raise ValueError(f"ledger record of {len(data)} bytes is over {RECORD_BYTES}")
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _read(fd: int) -> dict[str, Any] | None:
    try:
        record = json.loads(os.pread(fd, RECORD_BYTES, 0).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class LedgerBusy(Exception):
    """Another process holds the ledger's lock, and the transaction was not
    to wait for it (a decision in the engine core's step loop)."""


@dataclass
class View:
    """The ledger as one transaction sees it (its lock held)."""

    ledger: Ledger
    others: list[dict[str, Any]]
    """The live entries of the other instances."""

    def write(self, record: dict[str, Any]) -> None:
        """Replace this instance's entry."""
        _write(self.ledger.entry_fd, {**record, "label": self.ledger.label})
        self.ledger.record = dict(record)


class Ledger:
    """One instance's place in a device's ledger (see the module docstring)."""

    def __init__(self, folder: str, key: str, label: str | None = None) -> None:
        self.key = key
        self.label = label or holder_label()
        self.path = os.path.join(folder, folder_name(key))
        top = open_lock_folder(folder)
        try:
            self.dir_fd = open_folder(folder_name(key), self.path, "budget folder", LOCK_DIR_ADVICE, dir_fd=top)
        finally:
            os.close(top)
        try:
            lock_fd = open_regular(self.dir_fd, LEDGER_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            os.close(self.dir_fd)
            raise
        if lock_fd is None:
            os.close(self.dir_fd)
            raise LockSetupError(f"the ledger lock {os.path.join(self.path, LEDGER_LOCK)} is not a regular file")
        self.lock_fd = lock_fd
        with contextlib.suppress(OSError):
            if os.fstat(self.lock_fd).st_uid == os.geteuid():
                os.fchmod(self.lock_fd, 0o666)  # other users' instances lock it too
        self.entry_name = ""
        self.entry_fd = -1
        self.record: dict[str, Any] = {}

    @contextlib.contextmanager
    def transaction(self, wait: bool = True) -> Iterator[View]:
        """Hold the ledger's lock and see the other live entries. With
        ``wait=False``, raise :class:`LedgerBusy` at once when another
        process holds the lock: anyone who may open the lock file may hold
        it (a peer stopped mid-transaction, another user), and the step loop
        must never wait on it."""
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise LedgerBusy(f"{os.path.join(self.path, LEDGER_LOCK)} is locked by another process") from None
        try:
            if self.entry_fd < 0:  # join: created under the lock, so no reader sees it unlocked
                self.entry_name = f"{secrets.token_hex(8)}{ENTRY_SUFFIX}"
                fd = open_regular(self.dir_fd, self.entry_name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                if fd is None:
                    raise LockSetupError(f"the ledger entry {os.path.join(self.path, self.entry_name)} is not a file")
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.entry_fd = fd
            yield View(self, self._live_others())
        finally:
            fcntl.flock(self.lock_fd, fcntl.LOCK_UN)

    def _live_others(self) -> list[dict[str, Any]]:
        found = []
        for name in sorted(os.listdir(self.dir_fd)):
            if not name.endswith(ENTRY_SUFFIX) or name == self.entry_name:
                continue
            fd = open_regular(self.dir_fd, name, os.O_RDONLY)
            if fd is None:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # its owner holds it: alive
                    record = _read(fd)
                    if record is not None:
                        found.append(record)
                    continue
                # The owner is gone (the kernel dropped its lock): not counted.
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dir_fd)
            finally:
                os.close(fd)
        return found

    def close(self) -> None:
        """Leave the ledger (the share goes back to the others)."""
        if self.entry_fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.entry_name, dir_fd=self.dir_fd)
            os.close(self.entry_fd)
            self.entry_fd = -1
        for fd in (self.lock_fd, self.dir_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.lock_fd = self.dir_fd = -1
