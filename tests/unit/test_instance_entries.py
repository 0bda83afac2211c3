"""The instances' entries in the lock folder (``logic.instance_entries``): written
whole while their owner lives, not listed once it has died (nothing cleaned
up), files that are no entry reported one line each, and the shared
folders' rules (no link followed, regular files only, no folder others may
rename entries in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kv_cache_limit.logic import instance_entries
from vllm_kv_cache_limit.logic.shared_folder import LockSetupError

pytestmark = pytest.mark.unit

DEVICES = [("cpu-node0", "host memory node 0 (CPU backend)")]


def entry(**fields: object) -> dict[str, object]:
    return {**instance_entries.record(DEVICES, "tiny", 48 * 2**20, 2**20, True, 40 * 2**20), **fields}


def test_an_entry_is_read_back_whole_while_its_owner_holds_it(tmp_path: Path) -> None:
    held = instance_entries.Announcement(str(tmp_path), entry())
    try:
        found = instance_entries.read(str(tmp_path))
        assert [e.name for e in found] == [held.name] and found[0].problem is None
        record = found[0].record
        assert record is not None
        assert record["pid"] == os.getpid() and record["cap"] == 48 * 2**20 and record["floor"] == 2**20
        assert record["devices"] == [{"key": "cpu-node0", "label": "host memory node 0 (CPU backend)"}]
        assert record["budget"] == 40 * 2**20 and record["autoscale"] is True and record["status_url"] is None
        assert instance_entries.label(record).endswith(f"pid {os.getpid()}")
    finally:
        held.close()
    assert instance_entries.read(str(tmp_path)) == []
    assert list((tmp_path / instance_entries.FOLDER).iterdir()) == []  # a clean exit removes its file


def test_an_update_shorter_than_the_record_reads_whole(tmp_path: Path) -> None:
    long_url = "http://127.0.0.1:8000/" + "x" * 200
    held = instance_entries.Announcement(str(tmp_path), entry(status_url=long_url))
    try:
        held.update(status_url="http://127.0.0.1:8000/kv_cache/max_memory")
        (found,) = instance_entries.read(str(tmp_path))
        assert found.record is not None and found.record["status_url"] == "http://127.0.0.1:8000/kv_cache/max_memory"
    finally:
        held.close()


def test_the_entry_of_a_killed_process_is_not_listed_and_needs_no_cleanup(tmp_path: Path) -> None:
    code = (
        "import os, signal, sys\n"
        "from vllm_kv_cache_limit.logic import instance_entries\n"
        "a = instance_entries.Announcement(sys.argv[1], instance_entries.record([('cpu-node0', 'node 0')], 'tiny', 1 << 24))\n"
        "print(a.name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert child.returncode == -9, child.stderr
    name = child.stdout.strip()
    assert (tmp_path / instance_entries.FOLDER / name).is_file()  # left behind, as after any crash
    assert instance_entries.read(str(tmp_path)) == []
    # An instance engine_entry itself removes the dead entry (where it may).
    held = instance_entries.Announcement(str(tmp_path), entry())
    try:
        assert not (tmp_path / instance_entries.FOLDER / name).exists()
        assert [e.name for e in instance_entries.read(str(tmp_path))] == [held.name]
    finally:
        held.close()


def test_files_that_are_no_entry_are_each_one_line(tmp_path: Path) -> None:
    folder = tmp_path / instance_entries.FOLDER
    folder.mkdir(mode=0o755)
    (folder / "garbage.entry").write_bytes(b"\x00\xffnot json")
    (folder / "list.entry").write_text("[1, 2]")
    (folder / "old.entry").write_text(json.dumps({**entry(), "version": 0}))
    (folder / "nocap.entry").write_text(json.dumps({k: v for k, v in entry().items() if k != "cap"}))
    (folder / "link.entry").symlink_to(tmp_path / "elsewhere")
    (folder / "dir.entry").mkdir()
    (folder / ".hidden.new").write_text("being written")
    (folder / "notes.txt").write_text("not an entry's name")
    problems = {e.name: e.problem for e in instance_entries.read(str(tmp_path))}
    assert set(problems) == {"garbage.entry", "list.entry", "old.entry", "nocap.entry", "link.entry", "dir.entry"}
    assert "not JSON" in str(problems["garbage.entry"]) and "remove it" in str(problems["garbage.entry"])
    assert "not an object" in str(problems["list.entry"]) and "'[1, 2]'" in str(problems["list.entry"])
    assert "version 0, expected 1" in str(problems["old.entry"])
    assert "no 'cap' field" in str(problems["nocap.entry"])
    assert "not a regular file" in str(problems["link.entry"]) and "not a regular file" in str(problems["dir.entry"])


def test_an_entry_that_cannot_be_read_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's entry this user may not open. (Simulated: these tests
    may run as root, whom modes do not stop.)"""
    held = instance_entries.Announcement(str(tmp_path), entry())
    real = instance_entries.open_regular

    def refused(dir_fd: int, name: str, flags: int, mode: int = 0o644) -> int | None:
        if name == held.name:
            raise PermissionError(13, "Permission denied", name)
        return real(dir_fd, name, flags, mode)

    monkeypatch.setattr(instance_entries, "open_regular", refused)
    try:
        (found,) = instance_entries.read(str(tmp_path))
        assert (
            found.record is None and found.problem == "cannot be read (Permission denied); ask its owner, or remove it"
        )
    finally:
        held.close()


def test_a_missing_lock_folder_is_told_apart_from_an_empty_one(tmp_path: Path) -> None:
    with pytest.raises(instance_entries.FolderMissing):
        instance_entries.read(str(tmp_path / "absent"))
    assert instance_entries.read(str(tmp_path)) == []  # a lock folder no instance announced in
    assert not (tmp_path / instance_entries.FOLDER).exists()  # reading creates nothing
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="not a plain folder"):
        instance_entries.read(str(tmp_path / "file"))


def test_the_folders_follow_the_shared_folders_rule(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(LockSetupError, match="not a plain folder"):
        instance_entries.Announcement(str(tmp_path / "link"), entry())
    open_to_all = tmp_path / "locks"
    (open_to_all / instance_entries.FOLDER).mkdir(parents=True)
    os.chmod(open_to_all / instance_entries.FOLDER, 0o777)  # others could remove the instances' entries
    with pytest.raises(LockSetupError, match="writable by others without the sticky bit"):
        instance_entries.Announcement(str(open_to_all), entry())
    os.chmod(open_to_all / instance_entries.FOLDER, 0o1777)
    instance_entries.Announcement(str(open_to_all), entry()).close()


def test_parse_refuses_a_wrong_type_quoting_it() -> None:
    with pytest.raises(ValueError, match="field 'pid' is 'twelve'"):
        instance_entries.parse(json.dumps({**entry(), "pid": "twelve"}).encode())
    with pytest.raises(ValueError, match="field 'autoscale' is 1"):
        instance_entries.parse(json.dumps({**entry(), "autoscale": 1}).encode())
    with pytest.raises(ValueError, match="device 'gpu0'"):
        instance_entries.parse(json.dumps({**entry(), "devices": ["gpu0"]}).encode())
