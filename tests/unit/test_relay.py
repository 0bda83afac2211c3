"""The cap-error relay from child processes to the first process: a private
folder, the first error kept, no planted symlink followed."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_kv_cache_limit.logic import envs, relay


@pytest.fixture
def armed_relay(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.delenv(envs.ERROR_FILE, raising=False)
    monkeypatch.setattr(relay, "_relay_dir", None)
    relay.arm_error_relay()
    path = os.environ[envs.ERROR_FILE]
    yield path
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def test_relay_lies_in_a_folder_private_to_the_first_process(armed_relay: str) -> None:
    folder = os.path.dirname(armed_relay)
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert os.stat(folder).st_uid == os.getuid()
    relay.relay_cap_error("the cap error")
    assert relay.take_relayed_error() == "the cap error"
    assert not os.path.exists(armed_relay)
    assert relay.take_relayed_error() is None


def test_relay_keeps_the_first_error(armed_relay: str) -> None:
    relay.relay_cap_error("first")
    relay.relay_cap_error("second")
    assert relay.take_relayed_error() == "first"


def test_relay_follows_no_planted_symlink(armed_relay: str, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("untouched")
    os.symlink(target, armed_relay)
    relay.relay_cap_error("the cap error")
    assert target.read_text() == "untouched"
    assert relay.take_relayed_error() is None  # a symlink is not read either
    assert target.read_text() == "untouched"


def test_relay_says_whether_the_first_process_will_find_a_cap_error(
    armed_relay: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An engine-core process exits quietly only where the first process will
    raise its error: the relay must say so, and say no otherwise."""
    assert relay.relay_cap_error("first") is True
    assert relay.relay_cap_error("second") is True  # the first one is there
    assert relay.take_relayed_error() == "first"
    os.symlink(tmp_path / "elsewhere", armed_relay)
    assert relay.relay_cap_error("the cap error") is False  # a link is never read
    os.unlink(armed_relay)
    monkeypatch.delenv(envs.ERROR_FILE)
    assert relay.relay_cap_error("the cap error") is False  # no relay armed
