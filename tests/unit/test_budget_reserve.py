"""A starting instance's reservation in the shared budget's ledger
(``shared_budget.reserve``): written before vLLM allocates, holding the
cap, over the budget if need be, so that no other instance grows into that
memory; the join rewrites the same entry to what the workers still
commit; a budget that differs is refused before anything is allocated; a
failed in-process start leaves the ledger. Real ledger files, vLLM's own
config classes; the engines are ``test_autoscaling``'s stand-ins."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config import CacheConfig, ParallelConfig  # noqa: E402

from tests.unit.test_autoscaling import BPB, DEVICES, Engine, new_autoscaler, started  # noqa: E402
from vllm_kv_cache_limit.hooks.runtime import autoscaler, shared_budget  # noqa: E402
from vllm_kv_cache_limit.logic.budget_ledger import ENTRY_SUFFIX, folder_name  # noqa: E402
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError  # noqa: E402

BUDGET = 300 * BPB
CAP = 350 * BPB
"""Above the budget, as a cap may be: the start-up allocation alone over-commits it."""


def vllm_config(budget: int = BUDGET) -> Any:
    cache_config = CacheConfig()
    cache_config.kv_cache_max_memory = CAP  # as the plugin's argument sets it
    setattr(cache_config, autoscaler.AUTOSCALE, True)
    setattr(cache_config, autoscaler.MIN_MEMORY, None)
    setattr(cache_config, autoscaler.SHARED_BUDGET, budget)
    return SimpleNamespace(cache_config=cache_config, parallel_config=ParallelConfig())


@pytest.fixture
def one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device: one memory node, one worker on it."""
    device = SimpleNamespace(key=DEVICES[0][0], label=DEVICES[0][1])
    monkeypatch.setattr(shared_budget, "instance_devices", lambda config: ([device], 1))


def entries(folder: Path) -> dict[str, dict[str, Any]]:
    return {
        path.name: json.loads(path.read_text())
        for path in (folder / folder_name(DEVICES[0][0])).iterdir()
        if path.name.endswith(ENTRY_SUFFIX)
    }


def test_the_reservation_holds_the_cap_over_the_budget_and_the_join_rewrites_it(
    tmp_path: Path, one_device: None
) -> None:
    first = Engine()
    a = started(first, new_autoscaler(first, BUDGET), tmp_path)
    a.hysteresis.target = 100  # its demand asks for 100 blocks
    reservation = shared_budget.reserve(vllm_config(), str(tmp_path))
    assert reservation is not None
    try:
        name = reservation.ledgers["cpu-node0"].entry_name
        held = entries(tmp_path)[name]
        assert held["holds"] == CAP and held["instance"] == reservation.instance
        # The budget is over-committed: the running instance cannot grow into it.
        assert a._within_budget(a.floor, 100, None) == (None, False)
        second = Engine()
        b = new_autoscaler(second, BUDGET)
        second.set_limit(second, b.floor * BPB, "drain")  # fell to its floor
        shared_budget.join(b, DEVICES, str(tmp_path), committed=lambda: b.floor, reservation=reservation)
        after = entries(tmp_path)
        assert set(after) == {name, a.ledgers[0].entry_name}, "the join rewrote the reserved entry"
        assert after[name]["holds"] == b.floor * BPB and after[name]["instance"] == b.instance
        assert reservation.ledgers == {}
        assert a._within_budget(a.floor, 100, None) == (100, False)  # the memory is back
    finally:
        reservation.close()
        for scaler in (a, locals().get("b")):
            if scaler is not None:
                scaler.close()
    assert entries(tmp_path) == {}


def test_a_reservation_with_another_budget_is_refused_before_anything_is_allocated(
    tmp_path: Path, one_device: None
) -> None:
    first = Engine()
    a = started(first, new_autoscaler(first, BUDGET), tmp_path)
    try:
        with pytest.raises(KVCacheMaxMemoryError) as refused:
            shared_budget.reserve(vllm_config(200 * BPB), str(tmp_path))
        assert "--kv-cache-shared-budget 200KiB (204800 bytes) differs from the 300KiB (307200 bytes)" in str(
            refused.value
        )
        assert list(entries(tmp_path)) == [a.ledgers[0].entry_name]
    finally:
        a.close()


def test_a_failed_in_process_start_leaves_the_ledger(tmp_path: Path, one_device: None) -> None:
    reservation = shared_budget.reserve(vllm_config(), str(tmp_path))
    assert reservation is not None and len(entries(tmp_path)) == 1
    shared_budget.leave_after_failure(object(), reservation)  # not an engine core process
    assert entries(tmp_path) == {}


def test_no_reservation_without_a_shared_budget(tmp_path: Path) -> None:
    config = vllm_config()
    setattr(config.cache_config, autoscaler.SHARED_BUDGET, None)
    assert shared_budget.reserve(config, str(tmp_path)) is None
    assert not list(tmp_path.iterdir())
