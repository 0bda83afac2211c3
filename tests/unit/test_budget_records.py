"""What a shared budget's ledger takes from its folder, which any user of
the device may write to: a record that is not an instance's entry is
skipped with one warning and never stops a join or a decision, and a
ledger lock that another process keeps is waited for within a bound, then
named with its holder."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_kv_cache_limit.hooks.runtime import autoscaler, shared_budget  # noqa: E402
from vllm_kv_cache_limit.logic.autoscale_policy import Hysteresis, Policy  # noqa: E402
from vllm_kv_cache_limit.logic.budget_ledger import (  # noqa: E402
    ENTRY_SUFFIX,
    LEDGER_LOCK,
    Ledger,
    LedgerBusy,
    folder_name,
)
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError  # noqa: E402
from vllm_kv_cache_limit.logic.limit_math import Allocation  # noqa: E402

BPB = 1024
BLOCKS = 400
BUDGET = 300 * BPB
DEVICES = [("cpu-node0", "host memory node 0")]
LOGGER = "vllm.plugins.kv_cache_limit"

HOLD_LOCK = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.read()
    """
)


class Engine:
    """A stand-in engine core: no requests but those a test gives, and the limit it was set to."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.limit = BLOCKS
        self.withheld: set[int] = set()

    @property
    def scheduler(self) -> Engine:
        return self

    def set_limit(self, engine: Any, nbytes: int, mode: str, lazy: bool = False) -> dict[str, Any]:
        self.limit = nbytes // BPB
        self.withheld = set(range(self.limit, BLOCKS))
        return {"kv_cache_limit_bytes": nbytes}


class Request:
    def __init__(self, tokens: int) -> None:
        self.num_tokens = self.num_prompt_tokens = tokens
        self.max_tokens = 1


def new_scaler(engine: Engine, budget: int = BUDGET, floor: int = 20) -> autoscaler.Autoscaler:
    allocation = Allocation(num_blocks=BLOCKS, bytes_per_block=BPB, blocks_per_request=8, max_model_len=128)
    return autoscaler.Autoscaler(
        allocation=allocation,
        hysteresis=Hysteresis(Policy(floor, allocation.blocks_per_request, shrink_after_s=1000.0)),
        ceiling=BLOCKS,
        set_limit=engine.set_limit,
        group_caps=[(16, 8)],
        max_model_len=128,
        budget=budget,
    )


@pytest.fixture
def no_hang() -> Iterator[None]:
    """Fail, instead of hanging, a test whose join blocks."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError("blocked on the ledger lock past the test's 20 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(20)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def held_lock(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the ledger lock of ``tmp_path``'s budget (a
    peer stopped in a transaction, or anyone who may open it)."""
    Ledger(str(tmp_path), DEVICES[0][0], label="creates the folder").close()
    path = tmp_path / folder_name(DEVICES[0][0]) / LEDGER_LOCK
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        if proc.returncode is None:
            proc.communicate("", timeout=30)


def test_joining_while_another_process_holds_the_ledger_lock_fails_within_the_bound(
    tmp_path: Path, held_lock: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch, no_hang: None
) -> None:
    monkeypatch.setattr(shared_budget, "JOIN_TIMEOUT_S", 2.0)
    scaler = new_scaler(Engine())
    started = time.monotonic()
    with pytest.raises(KVCacheMaxMemoryError) as refused:
        shared_budget.join(scaler, DEVICES, str(tmp_path))
    waited = time.monotonic() - started
    assert 2.0 <= waited < 10.0, waited
    message = str(refused.value)
    assert "--kv-cache-shared-budget 300KiB" in message, message
    assert str(tmp_path / folder_name(DEVICES[0][0]) / LEDGER_LOCK) in message, message
    assert f"pid {held_lock.pid}" in message, message  # the holder, from /proc/locks
    assert "test_budget_records" in message or "python" in message, message  # and its command line
    assert scaler.ledgers == [] and list((tmp_path / folder_name(DEVICES[0][0])).glob(f"*{ENTRY_SUFFIX}")) == []


def test_a_transaction_given_seconds_waits_at_most_those_and_names_the_holder(
    tmp_path: Path, held_lock: subprocess.Popen[str], no_hang: None
) -> None:
    ledger = Ledger(str(tmp_path), DEVICES[0][0], label="me")
    try:
        started = time.monotonic()
        with pytest.raises(LedgerBusy, match=f"pid {held_lock.pid}"):
            with ledger.transaction(wait=1.0):
                pass
        assert 1.0 <= time.monotonic() - started < 8.0
        held_lock.communicate("", timeout=30)  # the holder ends: its lock goes with it
        with ledger.transaction(wait=1.0) as view:  # free again: taken
            assert view.others == []
    finally:
        ledger.close()


def valid(**changes: Any) -> dict[str, Any]:
    record = {"instance": "f" * 16, "budget": BUDGET, "floor": 20 * BPB, "holds": 20 * BPB, "wants": 20 * BPB}
    record.update(changes)
    return {k: v for k, v in record.items() if v is not DROP}


DROP = object()
MALFORMED = {
    "no floor": valid(floor=DROP),
    "floor a string": valid(floor="lots"),
    "holds NaN": valid(holds=float("nan")),
    "wants infinite": valid(wants=float("inf")),
    "holds a list": valid(holds=[1]),
    "floor negative": valid(floor=-5),
    "holds true": valid(holds=True),
    "budget a string": valid(budget="300K"),
    "budget missing": valid(budget=DROP),
    "needs a string": valid(needs="most"),
    "needs negative": valid(needs=-1),
    "needs true": valid(needs=True),
    "not an object": [1, 2],
}


def plant(folder: Path, name: str, record: Any) -> int:
    """A live entry: this process holds its lock on the returned descriptor, as its owner would."""
    path = folder / folder_name(DEVICES[0][0]) / f"{name}{ENTRY_SUFFIX}"
    path.write_text(json.dumps(record))
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def skipped(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"{name}{ENTRY_SUFFIX}" in r.getMessage()]


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_live_entry_is_skipped_once_and_join_and_decisions_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    Ledger(str(tmp_path), DEVICES[0][0], label="creates the folder").close()
    handle = plant(tmp_path, "planted", MALFORMED[case])
    engine = Engine()
    scaler = new_scaler(engine)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            shared_budget.join(scaler, DEVICES, str(tmp_path))
            assert scaler.held == scaler.floor and scaler.others == []
            engine.set_limit(engine, scaler.floor * BPB, "drain")
            engine.requests = {str(i): Request(15) for i in range(100)}  # 100 blocks wanted
            for step in range(5):
                scaler.tick(engine, engine, 100.0 + step)
        assert engine.limit > scaler.floor, engine.limit  # it grew into the budget
        assert scaler.failing.count == 0
        (warning,) = skipped(caplog, "planted")  # once, however many reads
        assert "not counted" in warning, warning
    finally:
        scaler.close()
        os.close(handle)


def test_a_live_valid_entry_with_another_budget_refuses_the_newcomer_naming_both(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    Ledger(str(tmp_path), DEVICES[0][0], label="creates the folder").close()
    handle = plant(tmp_path, "other", {**valid(budget=500 * BPB), "label": "host pid 7"})
    try:
        with pytest.raises(KVCacheMaxMemoryError) as refused:
            shared_budget.join(new_scaler(Engine()), DEVICES, str(tmp_path))
        message = str(refused.value)
        assert "300KiB (307200 bytes)" in message and "500KiB (512000 bytes)" in message, message
        assert "host pid 7" in message, message
    finally:
        os.close(handle)
    # Once its owner is gone the entry no longer counts, and the budget may be joined.
    scaler = new_scaler(Engine())
    try:
        shared_budget.join(scaler, DEVICES, str(tmp_path))
        assert scaler.held == scaler.floor
    finally:
        scaler.close()


def test_a_running_instance_counts_a_live_entry_with_another_budget_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine()
    scaler = new_scaler(engine)
    shared_budget.join(scaler, DEVICES, str(tmp_path))
    engine.set_limit(engine, scaler.floor * BPB, "drain")
    handle = plant(tmp_path, "other", {**valid(budget=500 * BPB, holds=250 * BPB), "label": "host pid 7"})
    try:
        engine.requests = {str(i): Request(15) for i in range(200)}
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for step in range(5):
                scaler.tick(engine, engine, 100.0 + step)
        assert engine.limit * BPB <= BUDGET - 250 * BPB, engine.limit  # its holds are memory in use
        assert scaler.failing.count == 0
        (warning,) = [r.getMessage() for r in caplog.records if "500KiB" in r.getMessage()]
        assert "host pid 7" in warning and "300KiB" in warning, warning
    finally:
        scaler.close()
        os.close(handle)


def test_each_ledger_object_warns_on_its_own(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The warned entries belong to the instance's ledger, not to the module."""
    first = Ledger(str(tmp_path), DEVICES[0][0], label="first")
    handle = plant(tmp_path, "planted", valid(floor=DROP))
    second = Ledger(str(tmp_path), DEVICES[0][0], label="second")
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for ledger in (first, second, first, second):
                with ledger.transaction() as view:
                    assert view.others == []
        assert len(skipped(caplog, "planted")) == 2
    finally:
        first.close()
        second.close()
        os.close(handle)
