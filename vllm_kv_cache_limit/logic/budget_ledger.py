"""The ledger of a device's shared KV cache budget: one file per instance.

Instances started with the same ``--kv-cache-shared-budget`` for a device
write what they hold and wish for into ``budget-<device key>/`` in the
start-up lock folder (``startup_lock.lock_dir``). Each instance's entry is
a file it created (``O_EXCL``) and holds an ``flock`` on for as long as its
engine core lives; the kernel drops that lock when the process dies, however
it dies, so a reader that can lock an entry knows its owner is gone and
ignores it (and removes it where it may), unless one of the instance's
workers still holds a companion of the entry (:data:`COMPANION_INFIX`):
the workers hold the memory, and a worker's lock goes only as it exits. No
pid is ever compared, so a
reused pid cannot keep a dead share alive, also across containers (``flock``
works on the shared file, whatever the PID namespace). Every read and write
of the ledger happens under the folder's ``ledger.lock``, so an instance
always sees the others' entries whole, and a grow is checked against all
of them at once.

Files are opened relative to the folder without following links
(``O_NOFOLLOW``); the folder itself must pass the shared folders' rule
(``shared_folder``): a plain directory, sticky when others may write to it,
or a group's folder (mode 2770) that restricts the budget to that group.
Whoever may write to the folder may plant an entry and lock it: every
record read is checked (:func:`record_problem`), and one that is not an
instance's entry is skipped, with one warning per entry and ``Ledger``.
No wait for the ledger's lock is unbounded (``transaction``).
No vLLM import here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from vllm_kv_cache_limit.logic.shared_folder import LockSetupError, lock_holders, open_folder, open_regular
from vllm_kv_cache_limit.logic.sizes import format_size
from vllm_kv_cache_limit.logic.startup_lock import LOCK_DIR_ADVICE, holder_label, lock_name, open_lock_folder

logger = logging.getLogger("vllm.plugins.kv_cache_limit")

LEDGER_LOCK = "ledger.lock"
ENTRY_SUFFIX = ".entry"
COMPANION_INFIX = ".w"
"""A worker's companion of its instance's entry, ``<entry>.w<rank>``:
created and locked by the worker (:class:`Companions`) for as long as it
lives. The kernel drops that lock as the worker exits, after its memory is
gone (``exit_mm`` runs before ``exit_files``), so an entry whose engine core
died first (a SIGKILL of the process group) is counted while a companion is
locked: its workers may take seconds more to exit, their memory held. Only
a companion owned by the entry's owner counts. Its name does not end in
:data:`ENTRY_SUFFIX`: readers of earlier releases pass it by."""
_ENTRY_NAME = re.compile(r"[0-9a-f]{16}" + re.escape(ENTRY_SUFFIX))
RECORD_BYTES = 4096
WAIT_S = 30.0
"""The longest a transaction waits for the ledger's lock unless told
otherwise: a transaction holds it for milliseconds, so a lock held longer
is kept by a process that is stopped or is no instance."""
POLL_S = 0.02
AMOUNTS = ("budget", "floor", "holds", "wants")
"""The fields of an entry that are bytes: whole numbers, at least 0."""
OPTIONAL_AMOUNTS = ("needs",)
"""Fields of bytes an entry may leave out (an instance of an earlier release)."""
NAMES = ("instance", "label")
"""The fields of an entry that are text (optional: ``label`` is the ledger's)."""
MOST_BYTES = 1 << 60


def folder_name(key: str) -> str:
    """The ledger folder of a device key such as ``cpu-node0``."""
    return "budget-" + lock_name(key).removesuffix(".lock")


def _write(fd: int, record: dict[str, Any]) -> None:
    data = json.dumps(record, sort_keys=True).encode()
    if len(data) > RECORD_BYTES:
        raise ValueError(f"ledger record of {len(data)} bytes is over {RECORD_BYTES}")
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _read(fd: int) -> Any:
    """The JSON value of an entry; ``ValueError`` saying why there is none."""
    data = os.pread(fd, RECORD_BYTES, 0)
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError too
        raise ValueError(f"not JSON ({exc}; starts {data[:40]!r})") from None


def record_problem(record: Any) -> str | None:
    """Why ``record`` is not an instance's entry, or None when it is: the
    amounts whole numbers of bytes (not NaN, a string, a bool), at least 0
    (the budget more), below 1 EiB; the names text."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    for name in (*AMOUNTS, *OPTIONAL_AMOUNTS):
        value = record.get(name)
        if name not in record:
            if name in OPTIONAL_AMOUNTS:
                continue
            return f"no {name!r} field"
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{name!r} is {value!r}, not a whole number of bytes"
        if not (1 if name == "budget" else 0) <= value < MOST_BYTES:
            return f"{name!r} is {value}, out of range"
    for name in NAMES:
        if name in record and not isinstance(record[name], str):
            return f"{name!r} is {record[name]!r}, not text"
    return None


class LedgerBusy(Exception):
    """Another process holds the ledger's lock past the time the transaction
    was to wait for it (none: a decision in the engine core's step loop)."""


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

    def __init__(self, folder: str, key: str, label: str | None = None, budget: int | None = None) -> None:
        self.folder = folder
        self.key = key
        self.label = label or holder_label()
        self.budget = budget
        """This instance's budget: a live entry that gave another is reported (once)."""
        self.reported: set[str] = set()
        """The entries already warned about (by name), so each is reported once."""
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
        self.lock_fd = lock_fd  # 0666 (open_regular): other users' instances lock it too
        self.entry_name = ""
        self.entry_fd = -1
        self.record: dict[str, Any] = {}
        _forget_in_forked_children(self)

    @contextlib.contextmanager
    def transaction(self, wait: bool | float = True) -> Iterator[View]:
        """Hold the ledger's lock and see the other live entries. Anyone who
        may open the lock file may hold it (a peer stopped mid-transaction,
        another user), so the wait for it is bounded: ``wait`` seconds
        (``True``: :data:`WAIT_S`), then :class:`LedgerBusy` naming the
        holder where ``/proc/locks`` shows it. ``wait=False``: at once (the
        step loop never waits on it)."""
        self._lock(WAIT_S if wait is True else float(wait))
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

    def _lock(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(POLL_S, left))
        path = os.path.join(self.path, LEDGER_LOCK)
        if seconds <= 0:
            raise LedgerBusy(f"{path} is locked by another process")
        holder = lock_holders(self.lock_fd) or "a process not shown in /proc/locks (another PID namespace)"
        raise LedgerBusy(f"{path} was locked for {seconds:.1f} s by {holder}")

    def _report(self, name: str, message: str, *args: Any) -> None:
        if name not in self.reported:
            self.reported.add(name)
            logger.warning(message, os.path.join(self.path, name), *args)

    def _checked(self, name: str, fd: int) -> dict[str, Any] | None:
        """The record of a live entry, or None (reported once) when it is not an instance's."""
        try:
            record = _read(fd)
            problem = record_problem(record)
        except (OSError, ValueError) as exc:
            problem = str(exc)
        if problem is not None:
            self._report(
                name,
                "The shared KV cache budget's ledger entry %s is not an instance's entry (%s); it is not counted "
                "while the process that holds it lives (logged once). Remove it, or end that process.",
                problem,
            )
            return None
        if self.budget is not None and record["budget"] != self.budget:
            self._report(
                name,
                "The shared KV cache budget's ledger entry %s, of %s, gives a budget of %s; this instance's is %s. "
                "Its holds are counted (logged once); every instance sharing a device must give the same budget.",
                record.get("label"),
                format_size(record["budget"]),
                format_size(self.budget),
            )
        return dict(record)

    def _live_others(self) -> list[dict[str, Any]]:
        found = []
        names = sorted(os.listdir(self.dir_fd))
        for name in names:
            if not name.endswith(ENTRY_SUFFIX) or name == self.entry_name:
                continue
            fd = open_regular(self.dir_fd, name, os.O_RDONLY)
            if fd is None:
                continue
            try:
                if held(self.dir_fd, name, fd, names):  # its engine core or one of its workers lives
                    record = self._checked(name, fd)
                    if record is not None:
                        found.append(record)
                    continue
                # The owner and its workers are gone (the kernel dropped their locks): not counted.
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dir_fd)
                _remove_unlocked(self.dir_fd, companions_of(name, names))
            finally:
                os.close(fd)
        entries = {name for name in names if name.endswith(ENTRY_SUFFIX)}
        _remove_unlocked(self.dir_fd, [n for n in names if _companion_entry(n) not in (None, *entries)])
        return found

    def forget(self) -> None:
        """Close this ledger's descriptors without touching the files: in a
        child forked from its owner, which must not keep the entry's lock
        (and with it the share) alive once the owner is gone, nor remove the
        owner's entry. Unlocking there would unlock the owner's too (the
        lock is on the descriptions both processes share): only closed."""
        for fd in (self.entry_fd, self.lock_fd, self.dir_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.entry_fd = self.lock_fd = self.dir_fd = -1
        self.entry_name = ""

    def close(self) -> None:
        """Leave the ledger (the share goes back to the others), and remove
        the companions of workers that have exited."""
        if self.entry_fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self.entry_name, dir_fd=self.dir_fd)
                _remove_unlocked(self.dir_fd, companions_of(self.entry_name, os.listdir(self.dir_fd)))
            os.close(self.entry_fd)
            self.entry_fd = -1
        for fd in (self.lock_fd, self.dir_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.lock_fd = self.dir_fd = -1


def _forget_in_forked_children(ledger: Ledger | Companions) -> None:
    """Have a child forked while ``ledger`` (or a worker's companions)
    lives close its descriptors (``forget``): the registration holds it
    weakly, so it keeps nothing alive and does nothing once it is gone."""
    ref = weakref.ref(ledger)

    def after_in_child() -> None:
        found = ref()
        if found is not None:
            found.forget()

    os.register_at_fork(after_in_child=after_in_child)


def companions_of(entry: str, names: Iterable[str]) -> list[str]:
    """The companions of ``entry`` among the file ``names`` of its folder."""
    return [name for name in names if _companion_entry(name) == entry]


def _companion_entry(name: str) -> str | None:
    """The entry ``name`` is a companion of, or None when it is none."""
    entry, infix, rank = name.rpartition(COMPANION_INFIX)
    return entry if infix and rank.isdigit() and entry.endswith(ENTRY_SUFFIX) else None


def held(dir_fd: int, name: str, fd: int, names: Iterable[str]) -> bool:
    """Whether entry ``name`` of the folder ``dir_fd`` (open on ``fd``) has
    a live owner: its engine core holds its lock, or, that lock dropped, one
    of the instance's workers still holds a companion (owned by the entry's
    owner: one planted by another user keeps nothing counted). ``names``:
    the folder's files."""
    if _locked(fd):
        return True
    owner = os.fstat(fd).st_uid
    for companion in companions_of(name, names):
        companion_fd = open_regular(dir_fd, companion, os.O_RDONLY)
        if companion_fd is None:
            continue
        try:
            if os.fstat(companion_fd).st_uid == owner and _locked(companion_fd):
                return True
        finally:
            os.close(companion_fd)
    return False


def _remove_unlocked(dir_fd: int, names: Iterable[str]) -> None:
    """Remove the files ``names`` of the folder ``dir_fd`` that nobody holds locked."""
    for name in names:
        fd = open_regular(dir_fd, name, os.O_RDONLY)
        if fd is None:
            continue
        try:
            if not _locked(fd):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
        finally:
            os.close(fd)


def _locked(fd: int) -> bool:
    """Whether another open file description holds a lock on the file open on
    ``fd`` (if not, ``fd`` holds a shared one now, until it is closed)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


class Companions:
    """The companions one worker process holds of its instance's entries
    (:data:`COMPANION_INFIX`), each locked until the worker exits. A child
    the worker forks closes its copies (``os.register_at_fork``), so that it
    keeps no dead instance counted."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str], tuple[int, int, str]] = {}
        """By (ledger folder, entry name): the folder's descriptor, the
        companion's (holding its lock) and its name."""
        _forget_in_forked_children(self)

    def hold(self, folder: str, key: str, entry: str, rank: int) -> bool:
        """Create and lock ``<entry>.w<rank>`` beside ``entry`` in the ledger
        of device ``key`` in the lock folder ``folder``; whether it is held
        (now or already). False, and nothing created, when ``entry`` is not
        an entry's name or not in that folder (a worker on another host)."""
        path = os.path.join(folder, folder_name(key))
        if (path, entry) in self.held:
            return True
        if not _ENTRY_NAME.fullmatch(entry) or not os.path.isfile(os.path.join(path, entry)):
            return False
        top = open_lock_folder(folder)
        try:
            dir_fd = open_folder(folder_name(key), path, "budget folder", LOCK_DIR_ADVICE, dir_fd=top)
        finally:
            os.close(top)
        name = f"{entry}{COMPANION_INFIX}{int(rank)}"
        fd = None
        try:
            fd = open_regular(dir_fd, name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except FileExistsError:
            logger.warning(
                "The shared KV cache budget's ledger entry companion %s exists already (not this worker's); "
                "if this instance's engine core dies before this worker, its entry may go before this "
                "worker's memory does.",
                os.path.join(path, name),
            )
        except BaseException:
            for opened in (fd, dir_fd):
                if opened is not None:
                    os.close(opened)
            raise
        if fd is None:
            os.close(dir_fd)
            return False
        self.held[(path, entry)] = (dir_fd, fd, name)
        return True

    def forget(self) -> None:
        """Close the descriptors without unlocking (in a forked child: the
        lock is on the description the worker shares)."""
        for dir_fd, fd, _ in self.held.values():
            for opened in (fd, dir_fd):
                with contextlib.suppress(OSError):
                    os.close(opened)
        self.held.clear()

    def close(self) -> None:
        """Remove the companions and drop their locks (the worker's memory is gone)."""
        for dir_fd, fd, name in self.held.values():
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            for opened in (fd, dir_fd):
                with contextlib.suppress(OSError):
                    os.close(opened)
        self.held.clear()


def others_in(views: list[View]) -> list[dict[str, Any]]:
    """The other instances in the ledgers of this instance's devices, each
    once (a tensor-parallel instance has an entry in every device's ledger,
    all with its id); an entry without an id counts on its own."""
    found: dict[str, dict[str, Any]] = {}
    for view in views:
        for record in view.others:
            found.setdefault(str(record.get("instance") or f"entry {len(found)}"), record)
    return list(found.values())
