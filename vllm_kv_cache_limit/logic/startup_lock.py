"""A start-up lock per device, so that instances with a KV cache cap never
measure memory at the same time.

vLLM sizes its KV cache from device-wide free-memory readings: two instances
that load and profile at once each count the other's memory as their own
(vllm #55827, #17979). An instance started with a cap holds an advisory lock
(``flock``) per device from before its workers take their first memory
snapshot until its KV cache is allocated and warm-up (CUDA graph capture)
is done. The kernel drops the lock when the process dies, so a crashed
instance never blocks the next one. Instances without the plugin or without
a cap do not take part.

Lock files live in one folder (``VLLM_KV_CACHE_LIMIT_LOCK_DIR``, default
``<tmp>/vllm-kv-cache-limit``), shared by every user of the device. The folder
is opened with ``O_NOFOLLOW | O_DIRECTORY`` and each file with ``O_NOFOLLOW``
relative to it, so a planted symbolic link can redirect neither; a folder
whose entries others may rename is refused (``shared_folder``).

No vLLM import here: the vLLM glue in ``hooks.devices`` names the devices.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
import tempfile
import time
from dataclasses import dataclass, field

from vllm_kv_cache_limit.logic import envs
from vllm_kv_cache_limit.logic.shared_folder import LockSetupError, open_folder, open_regular

logger = logging.getLogger("vllm.plugins.kv_cache_limit")

LOCK_ENV = envs.STARTUP_LOCK
"""``0`` turns the start-up lock off (it is on whenever a cap is set)."""
LOCK_DIR_ENV = envs.LOCK_DIR
"""Folder of the lock files; every instance sharing a device must use the
same one (mount it into containers that share a GPU)."""
LOCK_TIMEOUT_ENV = envs.LOCK_TIMEOUT
"""Seconds to wait for a device's lock before starting without it."""
DEFAULT_TIMEOUT_S = 600.0
POLL_S = 0.1
REPORT_EVERY_S = 30.0
LABEL_GRACE_S = 2.0
"""How long a waiter may put off its first report for the holder to write
its name (it does so right after taking the lock), so the report names it."""
UNKNOWN_HOLDER = "another process"


def enabled(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether the start-up lock is on (``VLLM_KV_CACHE_LIMIT_STARTUP_LOCK``)."""
    return environ.get(LOCK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def lock_dir(environ: dict[str, str] | os._Environ = os.environ) -> str:
    """The folder of the lock files."""
    return environ.get(LOCK_DIR_ENV) or os.path.join(tempfile.gettempdir(), "vllm-kv-cache-limit")


def lock_timeout(environ: dict[str, str] | os._Environ = os.environ) -> float:
    """Seconds to wait for one device's lock; ``ValueError`` quoting a bad value."""
    return envs.seconds(LOCK_TIMEOUT_ENV, DEFAULT_TIMEOUT_S, "600", "0: do not wait", environ, finite=False)


def lock_name(key: str) -> str:
    """A file name for a device key such as ``GPU-1a2b...`` or ``cpu-node0``."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
    return f"{safe}.lock"


LOCK_DIR_ADVICE = f"remove it or set {LOCK_DIR_ENV} to another folder."
"""What the errors about the lock folder and the folders in it advise."""


def open_lock_folder(path: str) -> int:
    """Open (creating if needed) the lock folder under the shared folders'
    rule (``shared_folder``); the budget's folders live in it too."""
    return open_folder(path, path, "lock folder", LOCK_DIR_ADVICE)


def open_lock_file(folder: str, key: str) -> int:
    """Open the lock file of ``key`` in ``folder``: created if missing, never
    through a symbolic link, and only if it is a regular file."""
    dir_fd = open_lock_folder(folder)
    name = lock_name(key)
    try:
        # 0666 whatever the umask: other users of the device lock it too.
        fd = open_regular(dir_fd, name, os.O_RDWR | os.O_CREAT, 0o666)
        link = fd is None and stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except FileNotFoundError:
        fd, link = None, False
    finally:
        os.close(dir_fd)
    if fd is None:
        what = "is a symbolic link" if link else "is not a regular file"
        raise LockSetupError(
            f"the lock file {os.path.join(folder, name)} {what}; remove it or set {LOCK_DIR_ENV} to another folder"
        )
    return fd


def holder_label() -> str:
    """How other instances name this one in their log: its host name (in a
    container, the container's own) and its pid (in its PID namespace)."""
    return f"{socket.gethostname()} pid {os.getpid()}"


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    except OSError:
        return UNKNOWN_HOLDER
    return text or UNKNOWN_HOLDER


@dataclass
class HeldLocks:
    """The locks one instance holds; ``release()`` drops them all."""

    held: list[tuple[str, int]] = field(default_factory=list)
    acquired_at: float = 0.0
    waited_s: float = 0.0

    def release(self) -> None:
        if not self.held:
            return
        released_at = time.time()
        labels = ", ".join(label for label, _ in self.held)
        for _, fd in reversed(self.held):
            try:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self.held = []
        logger.info(
            "KV cache start-up lock released for %s after %.2f s held (acquired at %.3f, released at %.3f, pid %d).",
            labels,
            released_at - self.acquired_at,
            self.acquired_at,
            released_at,
            os.getpid(),
        )

    def __enter__(self) -> HeldLocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock_one(fd: int, label: str, path: str, timeout: float) -> bool:
    """Take the lock on ``fd``, waiting up to ``timeout`` seconds and saying
    whom it waits for; False when the wait timed out."""
    started = time.monotonic()
    next_report = started
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now - started >= timeout:
            logger.warning(
                "Gave up waiting for the KV cache start-up lock of %s after %.0f s "
                "(%s=%s); held by %s. Starting without it: memory readings may "
                "overlap with that instance's.",
                label,
                now - started,
                LOCK_TIMEOUT_ENV,
                f"{timeout:g}",
                _holder(fd),
            )
            return False
        if now >= next_report:
            holder = _holder(fd)
            if holder != UNKNOWN_HOLDER or now - started >= LABEL_GRACE_S:
                logger.info("Waiting for the KV cache start-up lock of %s (%s), held by %s.", label, path, holder)
                next_report = now + REPORT_EVERY_S
            # else: the holder writes its name just after it takes the lock; look again at the next poll.
        time.sleep(POLL_S)


def acquire(devices: list[tuple[str, str]], folder: str | None = None, timeout: float | None = None) -> HeldLocks:
    """Lock every ``(key, label)`` device, in key order (so that instances
    locking several devices cannot deadlock), and return the held locks.

    A device whose lock is not free within ``timeout`` seconds is skipped
    with a warning; a lock that cannot be opened is skipped with a warning
    too (the lock is an aid to measuring, never a reason to fail start-up).
    """
    folder = lock_dir() if folder is None else folder
    timeout = lock_timeout() if timeout is None else timeout
    started = time.monotonic()
    held = HeldLocks()
    for key, label in sorted(set(devices)):
        path = os.path.join(folder, lock_name(key))
        try:
            fd = open_lock_file(folder, key)
        except OSError as exc:
            logger.warning("No KV cache start-up lock for %s: %s.", label, exc)
            continue
        try:
            locked = _lock_one(fd, label, path, timeout)
        except OSError as exc:  # e.g. ENOLCK on a file system without locks
            logger.warning("No KV cache start-up lock for %s: %s.", label, exc)
            locked = False
        if not locked:
            os.close(fd)
            continue
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{holder_label()} since {time.time():.3f}\n".encode(), 0)
        except OSError:
            pass  # the holder's note only serves the waiters' log lines
        held.held.append((label, fd))
    held.acquired_at = time.time()
    held.waited_s = time.monotonic() - started
    if held.held:
        logger.info(
            "KV cache start-up lock acquired for %s after waiting %.2f s "
            "(acquired at %.3f, pid %d); other capped instances on these devices "
            "start after this one's KV cache is allocated.",
            ", ".join(label for label, _ in held.held),
            held.waited_s,
            held.acquired_at,
            os.getpid(),
        )
    return held
