"""The per-device start-up lock: exclusive between processes, waits saying
for whom, times out with a warning, dies with its holder, and never follows
a planted symbolic link."""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vllm_kv_cache_limit.logic import startup_lock

HOLDER = textwrap.dedent(
    """
    import sys, time
    from vllm_kv_cache_limit.logic import startup_lock
    held = startup_lock.acquire([(sys.argv[2], "test device")], folder=sys.argv[1], timeout=0)
    print("HELD" if held.held else "NOT HELD", flush=True)
    time.sleep(float(sys.argv[3]))
    held.release()
    """
)


def hold(folder: Path, key: str, seconds: float) -> subprocess.Popen:
    """A process that holds ``key``'s lock for ``seconds``; returns once held."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), key, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "HELD"
    return proc


def test_second_process_waits_for_the_holder_and_names_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = hold(tmp_path, "cpu-node0", 4)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="vllm.plugins.kv_cache_limit"):
        held = startup_lock.acquire([("cpu-node0", "host memory node 0")], folder=str(tmp_path), timeout=30)
        waited = time.monotonic() - started
        held.release()
    holder.wait(timeout=30)
    assert 0.5 < waited < 30
    assert f"held by {socket.gethostname()} pid {holder.pid} since" in caplog.text
    assert "Waiting for the KV cache start-up lock of host memory node 0" in caplog.text
    assert "acquired for host memory node 0 after waiting" in caplog.text
    assert "released for host memory node 0" in caplog.text


def test_waiter_names_a_holder_that_writes_its_name_just_after_locking(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder takes the lock, then writes its name: a waiter that came in
    between still names it, not "another process"."""
    import fcntl
    import threading

    startup_lock.acquire([("cpu-node0", "host memory node 0")], folder=str(tmp_path), timeout=0).release()
    fd = os.open(tmp_path / startup_lock.lock_name("cpu-node0"), os.O_RDWR | os.O_NOFOLLOW)
    fcntl.flock(fd, fcntl.LOCK_EX)

    def late_holder() -> None:
        time.sleep(0.3)
        os.pwrite(fd, b"late-host pid 7 since 0", 0)
        time.sleep(0.7)
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)

    thread = threading.Thread(target=late_holder)
    thread.start()
    try:
        with caplog.at_level(logging.INFO, logger="vllm.plugins.kv_cache_limit"):
            startup_lock.acquire([("cpu-node0", "host memory node 0")], folder=str(tmp_path), timeout=30).release()
    finally:
        thread.join()
        os.close(fd)
    assert "held by late-host pid 7 since 0" in caplog.text, caplog.text
    assert "held by another process" not in caplog.text, caplog.text


def test_timeout_starts_without_the_lock_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    holder = hold(tmp_path, "GPU-abc", 10)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.plugins.kv_cache_limit"):
            held = startup_lock.acquire([("GPU-abc", "cuda:0")], folder=str(tmp_path), timeout=0.3)
        assert held.held == []
        assert "Gave up waiting for the KV cache start-up lock of cuda:0" in caplog.text
        assert f"pid {holder.pid}" in caplog.text
    finally:
        holder.kill()
        holder.wait()


def test_lock_dies_with_its_holder(tmp_path: Path) -> None:
    holder = hold(tmp_path, "cpu-node0", 60)
    holder.kill()
    holder.wait()
    started = time.monotonic()
    with startup_lock.acquire([("cpu-node0", "node 0")], folder=str(tmp_path), timeout=5) as held:
        assert held.held
    assert time.monotonic() - started < 2


def test_locks_are_taken_in_key_order(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Instances locking several GPUs take them in one order: none can hold
    one GPU while waiting for another held by an instance waiting for it."""
    with caplog.at_level(logging.INFO, logger="vllm.plugins.kv_cache_limit"):
        with startup_lock.acquire(
            [("GPU-b", "cuda:1"), ("GPU-a", "cuda:0"), ("GPU-b", "cuda:1")], folder=str(tmp_path), timeout=1
        ) as held:
            assert [label for label, _ in held.held] == ["cuda:0", "cuda:1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["GPU-a.lock", "GPU-b.lock"]


def test_planted_symlink_lock_file_is_refused_and_its_target_untouched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "victim"
    target.write_text("precious")
    folder = tmp_path / "locks"
    folder.mkdir()
    (folder / "cpu-node0.lock").symlink_to(target)
    with pytest.raises(startup_lock.LockSetupError, match="is a symbolic link"):
        startup_lock.open_lock_file(str(folder), "cpu-node0")
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.kv_cache_limit"):
        held = startup_lock.acquire([("cpu-node0", "node 0")], folder=str(folder), timeout=1)
    assert held.held == [] and "No KV cache start-up lock for node 0" in caplog.text
    assert target.read_text() == "precious"


def test_planted_symlink_lock_folder_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir()
    (tmp_path / "locks").symlink_to(real)
    with pytest.raises(startup_lock.LockSetupError, match="not a plain folder"):
        startup_lock.open_lock_file(str(tmp_path / "locks"), "cpu-node0")
    assert list(real.iterdir()) == []


def test_new_lock_folder_is_shared_and_sticky(tmp_path: Path) -> None:
    folder = tmp_path / "locks"
    os.close(startup_lock.open_lock_file(str(folder), "GPU-x"))
    assert folder.stat().st_mode & 0o7777 == 0o1777
    assert (folder / "GPU-x.lock").stat().st_mode & 0o777 == 0o666


@pytest.mark.parametrize("mode", [0o777, 0o2777, 0o775, 0o770])
def test_a_lock_folder_others_may_rename_files_in_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int
) -> None:
    """The budget folder's rule holds for the lock folder: whoever may rename
    its files could swap a lock file under a waiting instance."""
    folder = tmp_path / "locks"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(startup_lock.LockSetupError, match=f"writable by .*\\(mode {mode:o}\\).*chmod \\+t"):
        startup_lock.open_lock_file(str(folder), "cpu-node0")
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.kv_cache_limit"):
        held = startup_lock.acquire([("cpu-node0", "node 0")], folder=str(folder), timeout=1)
    assert held.held == [] and "No KV cache start-up lock for node 0" in caplog.text
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("mode", [0o1777, 0o2770, 0o1770, 0o755])
def test_a_sticky_group_or_private_lock_folder_is_accepted(tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "locks"
    folder.mkdir()
    folder.chmod(mode)
    with startup_lock.acquire([("cpu-node0", "node 0")], folder=str(folder), timeout=1) as held:
        assert [label for label, _ in held.held] == ["node 0"]


def test_lock_file_names_are_plain() -> None:
    assert startup_lock.lock_name("GPU-1a2b-3c") == "GPU-1a2b-3c.lock"
    assert startup_lock.lock_name("../../etc/passwd") == ".._.._etc_passwd.lock"


def test_settings_from_the_environment() -> None:
    assert startup_lock.enabled({})
    assert not startup_lock.enabled({startup_lock.LOCK_ENV: "0"})
    assert startup_lock.lock_timeout({}) == startup_lock.DEFAULT_TIMEOUT_S
    assert startup_lock.lock_timeout({startup_lock.LOCK_TIMEOUT_ENV: "2.5"}) == 2.5
    assert startup_lock.lock_dir({startup_lock.LOCK_DIR_ENV: "/srv/locks"}) == "/srv/locks"
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ValueError, match=f"VLLM_KV_CACHE_LIMIT_LOCK_TIMEOUT='{bad}' is not a number of seconds"):
            startup_lock.lock_timeout({startup_lock.LOCK_TIMEOUT_ENV: bad})


def test_a_file_system_without_locks_never_fails_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.kv_cache_limit"):
        held = startup_lock.acquire([("cpu-node0", "node 0")], folder=str(tmp_path), timeout=1)
    assert held.held == []
    assert "No KV cache start-up lock for node 0" in caplog.text and "No locks available" in caplog.text


def test_a_lock_file_is_created_0666_whatever_the_umask(tmp_path: Path) -> None:
    """Other users' instances on the device lock it too: the mode is set in
    the shared folders' one place (``shared_folder.open_regular``)."""
    old = os.umask(0o077)
    try:
        fd = startup_lock.open_lock_file(str(tmp_path / "locks"), "cpu-node0")
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o666
    finally:
        os.close(fd)
