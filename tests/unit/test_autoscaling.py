"""The engine core's autoscaler (``hooks.runtime.autoscaler``) without an engine:
stand-in schedulers and block pools, real ledger files. Two autoscalers
share one budget: one grows into it, gives back when the other needs
blocks, does not take it again at once, and the holds never add up to more
than the budget; joining refuses a different budget and a budget below the
floors, quoting them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_kv_cache_limit.hooks.runtime import autoscaler, shared_budget, wakeups  # noqa: E402
from vllm_kv_cache_limit.hooks.runtime.limit import EngineCoreState  # noqa: E402
from vllm_kv_cache_limit.logic.autoscale_policy import Hysteresis, Policy  # noqa: E402
from vllm_kv_cache_limit.logic.budget_ledger import others_in  # noqa: E402
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError  # noqa: E402
from vllm_kv_cache_limit.logic.limit_math import Allocation  # noqa: E402

BPB = 1024
"""Bytes per block of the stand-in KV cache."""
BLOCKS = 400
BLOCK_SIZE = 16
DEVICES = [("cpu-node0", "host memory node 0")]


@dataclass
class Request:
    num_tokens: int
    num_prompt_tokens: int = 0
    max_tokens: int = 1


@dataclass
class Engine:
    """A stand-in engine core: its scheduler's requests and the limit on its pool."""

    requests: dict[str, Request] = field(default_factory=dict)
    limit: int = BLOCKS
    withheld: set[int] = field(default_factory=set)
    calls: list[int] = field(default_factory=list)
    lazy: list[bool] = field(default_factory=list)
    """Per call of ``set_limit``: whether the pages above the limit go back lazily."""

    @property
    def scheduler(self) -> Engine:
        return self

    def demand(self, blocks: int) -> None:
        """Requests that hold and need ``blocks`` blocks in all."""
        self.requests = {str(i): Request(BLOCK_SIZE - 1, BLOCK_SIZE - 1, 1) for i in range(blocks)}

    in_use_up_to: int = 0
    """Blocks below this stay in use (a drain above the limit waits for them)."""

    def set_limit(self, engine: Any, nbytes: int, mode: str, lazy: bool = False) -> dict[str, Any]:
        assert engine is self and mode == "drain"
        self.limit = nbytes // BPB
        self.calls.append(self.limit)
        self.lazy.append(lazy)
        self.settle()
        return {"kv_cache_limit_bytes": nbytes}

    def settle(self) -> None:
        """Withhold the free blocks above the limit (the drain holds once
        none above it is in use)."""
        self.withheld = set(range(max(self.limit, self.in_use_up_to), BLOCKS))


def new_autoscaler(engine: Engine, budget: int | None, floor: int = 20, workers: int = 1) -> autoscaler.Autoscaler:
    """``workers``: how many of its workers keep their KV cache on the device."""
    allocation = Allocation(num_blocks=BLOCKS, bytes_per_block=BPB, blocks_per_request=8, max_model_len=128)
    return autoscaler.Autoscaler(
        allocation=allocation,
        hysteresis=Hysteresis(Policy(floor, allocation.blocks_per_request, shrink_after_s=1000.0)),
        ceiling=BLOCKS,
        set_limit=engine.set_limit,
        group_caps=[(BLOCK_SIZE, 8)],
        max_model_len=128,
        budget=budget,
        device_bytes_per_block=workers * BPB,
    )


def join_refused(scaler: autoscaler.Autoscaler, folder: Path) -> str:
    """The message of the cap error joining the ledger raises."""
    with pytest.raises(KVCacheMaxMemoryError) as refused:
        shared_budget.join(scaler, DEVICES, str(folder))
    return str(refused.value)


def started(
    engine: Engine, scaler: autoscaler.Autoscaler, folder: Path, devices: list[tuple[str, str]] = DEVICES
) -> autoscaler.Autoscaler:
    shared_budget.join(scaler, devices, str(folder))
    engine.set_limit(engine, scaler.floor * BPB, "drain")
    scaler.held = scaler.floor
    return scaler


@pytest.fixture
def pair(tmp_path: Path):
    budget = 300 * BPB
    a, b = Engine(), Engine()
    sa = started(a, new_autoscaler(a, budget), tmp_path)
    sb = started(b, new_autoscaler(b, budget), tmp_path)
    yield a, sa, b, sb, budget
    sa.close()
    sb.close()


def tick(engine: Engine, scaler: autoscaler.Autoscaler, now: float) -> None:
    scaler.tick(engine, engine, now)


def test_demand_counts_each_request_to_its_max_tokens_within_max_model_len() -> None:
    engine = Engine()
    scaler = new_autoscaler(engine, None)
    engine.requests = {
        "new": Request(num_tokens=10, num_prompt_tokens=10, max_tokens=100),  # 110 tokens: 7 blocks
        "resumed": Request(num_tokens=50, num_prompt_tokens=10, max_tokens=20),  # past max_tokens: 51, 4 blocks
        "long": Request(num_tokens=100, num_prompt_tokens=100, max_tokens=1000),  # max_model_len 128: 8 blocks
    }
    assert scaler.read_demand(engine) == 7 + 4 + 8


def test_a_grow_is_decided_at_once_and_anything_else_at_most_every_tick() -> None:
    engine = Engine()
    scaler = new_autoscaler(engine, None)
    scaler.hysteresis = Hysteresis(Policy(20, 8, shrink_after_s=0.0))
    engine.set_limit(engine, 20 * BPB, "drain")
    tick(engine, scaler, 100.0)
    # Three requests arrive 10 ms later: their blocks do not fit, the limit grows before the next tick is due.
    engine.requests = {str(i): Request(num_tokens=5, num_prompt_tokens=5, max_tokens=500) for i in range(3)}
    tick(engine, scaler, 100.01)
    assert engine.limit == 24 + 8 + 1, engine.calls  # their 24 blocks, one request of headroom, the null block
    # They finish: with no hysteresis the shrink comes at the next due ticks, not before.
    engine.requests = {}
    tick(engine, scaler, 100.02)
    tick(engine, scaler, 100.03)
    assert engine.limit == 33
    tick(engine, scaler, 100.2)
    tick(engine, scaler, 100.4)
    assert engine.limit == 20, engine.calls
    # The grow returns no pages; the shrink after idling returns them lazily.
    assert engine.lazy[-2:] == [False, True], (engine.calls, engine.lazy)


def test_without_lazy_release_a_shrink_after_idling_returns_the_pages_at_once() -> None:
    engine = Engine()
    scaler = new_autoscaler(engine, None)
    scaler.lazy_release = False
    scaler.hysteresis = Hysteresis(Policy(20, 8, shrink_after_s=0.0))
    engine.set_limit(engine, 20 * BPB, "drain")
    engine.requests = {str(i): Request(num_tokens=5, num_prompt_tokens=5, max_tokens=500) for i in range(3)}
    tick(engine, scaler, 100.0)
    engine.requests = {}
    tick(engine, scaler, 100.2)
    tick(engine, scaler, 100.4)
    assert engine.calls[-2:] == [33, 20] and engine.lazy[-2:] == [False, False], (engine.calls, engine.lazy)


def test_a_fall_to_the_ceiling_returns_the_pages_at_once() -> None:
    engine = Engine()
    scaler = new_autoscaler(engine, None)
    scaler.hysteresis = Hysteresis(Policy(20, 8, shrink_after_s=0.0))
    engine.set_limit(engine, 100 * BPB, "drain")
    engine.demand(90)
    scaler.ceiling = 50
    tick(engine, scaler, 100.0)
    assert engine.calls[-1] == 50 and engine.lazy[-1] is False, (engine.calls, engine.lazy)


def test_a_demand_held_above_the_ceiling_is_not_decided_again_before_the_tick() -> None:
    engine = Engine()
    scaler = new_autoscaler(engine, None)
    scaler.ceiling = 30
    engine.set_limit(engine, 20 * BPB, "drain")
    decided: list[int] = []
    original = scaler.hysteresis.decide
    scaler.hysteresis.decide = lambda now, demand, *rest: (decided.append(demand), original(now, demand, *rest))[1]  # type: ignore[method-assign]
    engine.requests = {str(i): Request(num_tokens=5, num_prompt_tokens=5, max_tokens=500) for i in range(8)}
    tick(engine, scaler, 100.0)
    assert engine.limit == 30 and decided == [30]  # 64 blocks, counted up to the ceiling
    # Steps 10 ms apart with the same demand, above the ceiling: no decision until the tick is due.
    for step in range(1, 9):
        tick(engine, scaler, 100.0 + step / 100)
    assert decided == [30], decided
    # One more request raises the demand: the limit cannot grow past the ceiling, so it waits for the tick too.
    engine.requests["new"] = Request(num_tokens=5, num_prompt_tokens=5, max_tokens=500)
    tick(engine, scaler, 100.095)
    assert decided == [30], decided
    tick(engine, scaler, 100.11)
    assert decided == [30, 30], decided


def test_an_unchanged_entry_is_not_written_again(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_kv_cache_limit.logic import budget_ledger as ledger

    a, sa, b, sb, _ = pair
    writes: list[dict[str, Any]] = []
    original = ledger.View.write
    monkeypatch.setattr(ledger.View, "write", lambda view, record: (writes.append(record), original(view, record)))
    a.demand(50)
    tick(a, sa, 100.0)
    assert len(writes) == 1 and writes[0]["holds"] == a.limit * BPB
    for step in range(1, 6):
        tick(a, sa, 100.0 + step)
    assert len(writes) == 1, writes
    a.demand(150)
    tick(a, sa, 107.0)
    assert len(writes) == 2 and writes[1]["holds"] == a.limit * BPB


def test_one_grows_into_the_budget_and_gives_back_when_the_other_needs_it(pair) -> None:
    a, sa, b, sb, budget = pair
    now = 100.0
    a.demand(250)
    tick(a, sa, now)
    # A takes what its demand asks, at most the budget less B's floor.
    assert a.limit == budget // BPB - sb.floor
    assert (sa.held + sb.held) * BPB <= budget
    # B needs blocks; A, now idle, gives back (its hysteresis is 1000 s).
    a.demand(0)
    b.demand(250)
    tick(b, sb, now + 1)
    assert b.limit == sb.floor  # nothing free yet
    tick(a, sa, now + 1)
    assert a.limit == sa.floor
    # Another instance needs the memory: A returns it at once, not lazily.
    assert a.lazy[-1] is False, a.lazy
    # A's entry holds its old limit until its drain holds (its next decision).
    assert sa.held > sa.floor
    tick(a, sa, now + 2)
    assert sa.held == sa.floor
    tick(b, sb, now + 2)
    assert b.limit == budget // BPB - sa.floor
    assert (sa.held + sb.held) * BPB <= budget


def test_under_contention_the_budget_is_split_and_nobody_takes_it_back_at_once(pair) -> None:
    a, sa, b, sb, budget = pair
    now = 100.0
    a.demand(250)
    tick(a, sa, now)
    # A's requests hold its blocks: a lowered limit drains only as they finish.
    a.in_use_up_to = a.limit
    b.demand(250)
    for step in range(1, 40):
        if step == 20:
            a.in_use_up_to = 0  # they finished
            a.settle()
        tick(b, sb, now + step)
        tick(a, sa, now + step)
        assert (sa.held + sb.held) * BPB <= budget, step
        if step < 20:  # while A drains, B waits and A does not take back what it gave
            assert b.limit == sb.floor and a.calls[1:] == sorted(a.calls[1:], reverse=True), (step, a.calls)
    # Equal demand: about half each, and the limits settled (no give-back and grow-back each tick).
    assert abs(a.limit - b.limit) <= 2, (a.limit, b.limit)
    assert a.limit + b.limit <= budget // BPB
    settled = len(a.calls), len(b.calls)
    for step in range(40, 50):
        tick(b, sb, now + step)
        tick(a, sa, now + step)
    assert (len(a.calls), len(b.calls)) == settled, (a.calls[-6:], b.calls[-6:])


def test_a_different_budget_is_refused_quoting_both(pair, tmp_path: Path) -> None:
    c = Engine()
    message = join_refused(new_autoscaler(c, 200 * BPB), tmp_path)
    assert "--kv-cache-shared-budget 200KiB (204800 bytes) differs from the 300KiB (307200 bytes)" in message
    assert "must give the same budget" in message


def test_a_budget_below_the_floors_is_refused_quoting_them(tmp_path: Path) -> None:
    a = Engine()
    sa = started(a, new_autoscaler(a, 50 * BPB, floor=30), tmp_path)
    try:
        b = Engine()
        message = join_refused(new_autoscaler(b, 50 * BPB, floor=30), tmp_path)
        assert "--kv-cache-shared-budget 50KiB (51200 bytes) is below the floors" in message
        assert "this one's 30KiB" in message and "at least 60KiB (61440 bytes)" in message
    finally:
        sa.close()
    # The refused instance left no entry behind.
    assert len(list(tmp_path.glob("budget-*/*.entry"))) == 0


def test_shutdown_removes_the_ledger_entries_once_vllm_has_torn_down(tmp_path: Path) -> None:
    """``EngineCore.shutdown`` wrapped: the entry goes as the shutdown ends
    (not when the process exits, nor at the next reader), so an engine shut
    down in a process that goes on gives its share back; it stays while
    vLLM's shutdown frees the memory it counts, never going before it."""
    from vllm_kv_cache_limit.hooks.runtime.engine_core import _leave_budget_first
    from vllm_kv_cache_limit.logic.budget_ledger import ENTRY_SUFFIX, Ledger

    engine = Engine()
    scaler = started(engine, new_autoscaler(engine, 300 * BPB), tmp_path)
    entries = lambda: sorted(tmp_path.glob(f"budget-*/*{ENTRY_SUFFIX}"))  # noqa: E731
    assert len(entries()) == 1
    other = Ledger(str(tmp_path), DEVICES[0][0], label="other")
    with other.transaction() as view:
        assert [o["holds"] for o in view.others] == [scaler.floor * BPB]  # the premise: it is counted
    mine = scaler.ledgers[0].entry_name
    seen_by_vllm: list[list[str]] = []

    def shutdown(core: Any) -> str:
        seen_by_vllm.append([p.name for p in entries()])
        return "vLLM's result"

    core = type("Core", (), {})()
    EngineCoreState.of(core).autoscaler = scaler
    assert _leave_budget_first(shutdown)(core) == "vLLM's result"
    assert seen_by_vllm == [sorted([other.entry_name, mine])], (mine, seen_by_vllm)  # kept while vLLM frees
    assert EngineCoreState.of(core).autoscaler is None and scaler.stop.is_set() and scaler.ledgers == []
    with other.transaction() as view:
        assert view.others == []
    assert [p.name for p in entries()] == [other.entry_name]  # only the reader's own
    other.close()
    # Without autoscaling the original runs alone.
    plain = type("Core", (), {})()
    assert _leave_budget_first(lambda core: "alone")(plain) == "alone"


def test_a_failure_leaving_the_ledger_does_not_stop_vllms_shutdown(caplog: pytest.LogCaptureFixture) -> None:
    from vllm_kv_cache_limit.hooks.runtime.engine_core import _leave_budget_first

    class Broken:
        stop = threading.Event()
        orphaned = False

        def close(self) -> None:
            raise OSError("the ledger folder is gone")

    core = type("Core", (), {})()
    EngineCoreState.of(core).autoscaler = Broken()
    with caplog.at_level(logging.ERROR, logger="vllm.plugins.kv_cache_limit"):
        assert _leave_budget_first(lambda core: "vLLM's result")(core) == "vLLM's result"
    assert EngineCoreState.of(core).autoscaler is None
    assert "Leaving the shared KV cache budget's ledger failed" in caplog.text


def test_a_ledger_this_instance_may_not_write_is_refused_quoting_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's budget folder without write access for others: the
    entry cannot be created. (Simulated: these tests may run as root, whom
    modes do not stop.)"""
    from vllm_kv_cache_limit.logic import budget_ledger

    real = budget_ledger.open_regular

    def refuse_entries(dir_fd: int, name: str, flags: int, mode: int = 0o644) -> int | None:
        if name.endswith(budget_ledger.ENTRY_SUFFIX):
            raise PermissionError(13, "Permission denied", name)
        return real(dir_fd, name, flags, mode)

    monkeypatch.setattr(budget_ledger, "open_regular", refuse_entries)
    engine = Engine()
    scaler = new_autoscaler(engine, 300 * BPB)
    message = join_refused(scaler, tmp_path)
    assert f"--kv-cache-shared-budget: the ledger in {tmp_path} cannot be used" in message, message
    assert "Permission denied" in message and "VLLM_KV_CACHE_LIMIT_LOCK_DIR" in message, message
    assert scaler.ledgers == []  # closed: no descriptor left


def test_workers_sharing_a_device_count_once_each_in_its_ledger(tmp_path: Path) -> None:
    """Tensor parallel 2 on one CPU memory node: both workers hold the limit
    there, so the instance's entry holds twice a worker's bytes, and its
    limit grows only as far as the budget holds both workers' blocks."""
    budget = 300 * BPB
    a, b = Engine(), Engine()
    sa = started(a, new_autoscaler(a, budget, workers=2), tmp_path)
    sb = started(b, new_autoscaler(b, budget), tmp_path)
    try:
        a.demand(250)
        tick(a, sa, 100.0)
        # The premise: A's demand asks for more than the budget holds for two workers.
        assert sa.target * 2 * BPB > budget - sb.floor * BPB, sa.target
        assert a.limit == (budget - sb.floor * BPB) // (2 * BPB), a.calls
        # What the node holds: A's two workers at their limit, and B.
        assert 2 * a.limit * BPB + b.limit * BPB <= budget
        with sb.transaction() as views:
            assert [int(o["holds"]) for o in views[0].others] == [2 * a.limit * BPB]
        assert sa.status()["held_bytes"] == 2 * a.limit * BPB
        # B needs blocks; idle A gives back down to its floor, and B grows
        # into the budget less A's two workers' floors.
        a.demand(0)
        b.demand(250)
        tick(b, sb, 101.0)
        tick(a, sa, 101.0)
        tick(a, sa, 102.0)
        tick(b, sb, 102.0)
        assert a.limit == sa.floor and b.limit == (budget - 2 * sa.floor * BPB) // BPB, (a.calls, b.calls)
    finally:
        sa.close()
        sb.close()


def test_a_budget_below_the_floors_counts_every_worker_on_the_device(tmp_path: Path) -> None:
    a = Engine()
    sa = started(a, new_autoscaler(a, 50 * BPB, floor=20), tmp_path)
    try:
        message = join_refused(new_autoscaler(Engine(), 50 * BPB, floor=20, workers=2), tmp_path)
        # 20 blocks on each of two workers, and the other's 20: 60 blocks of 1KiB.
        assert "this one's 40KiB (its workers' floors on the device together) and 1 other(s)' 20KiB" in message
        assert "at least 60KiB" in message, message
    finally:
        sa.close()
    # Alone on the device, its workers' floors alone can be above the budget.
    message = join_refused(new_autoscaler(Engine(), 30 * BPB, floor=20, workers=2), tmp_path)
    assert "host memory node 0: this one's 40KiB (its workers' floors on the device together). Give" in message


def test_instances_with_one_label_are_each_counted(tmp_path: Path) -> None:
    """Two containers of one Kubernetes pod share a host name and may give
    their engine cores the same pid in their own PID namespaces: labels are
    for people, and every instance is counted however it is named (here
    three in one process, one label)."""
    budget = 300 * BPB
    engines = [Engine() for _ in range(3)]
    scalers = [started(engine, new_autoscaler(engine, budget), tmp_path) for engine in engines]
    (a, b, c), (sa, sb, sc) = engines, scalers
    try:
        assert len({ledger.label for s in scalers for ledger in s.ledgers}) == 1  # the premise
        a.demand(100)
        tick(a, sa, 100.0)
        b.demand(100)
        tick(b, sb, 100.0)
        c.demand(250)
        tick(c, sc, 100.0)
        assert len(sc.others) == 2, sc.others
        assert (a.limit + b.limit + c.limit) * BPB <= budget, (a.calls, b.calls, c.calls)
    finally:
        for scaler in scalers:
            scaler.close()


def test_an_instance_on_two_devices_counts_once(tmp_path: Path) -> None:
    two = [*DEVICES, ("cpu-node1", "host memory node 1")]
    engines = [Engine(), Engine()]
    scalers = [new_autoscaler(engine, 300 * BPB) for engine in engines]
    try:
        for scaler in scalers:
            shared_budget.join(scaler, two, str(tmp_path))
        # Each sees the other in both ledgers, with one id: one instance.
        with scalers[1].transaction() as views:
            assert [len(view.others) for view in views] == [1, 1]
            assert len(others_in(views)) == 1
    finally:
        for scaler in scalers:
            scaler.close()


def test_instances_on_different_devices_do_not_share_a_budget(tmp_path: Path) -> None:
    a, b = Engine(), Engine()
    budget = 300 * BPB
    sa = started(a, new_autoscaler(a, budget), tmp_path)
    sb = started(b, new_autoscaler(b, budget), tmp_path, [("cpu-node1", "host memory node 1")])
    try:
        a.demand(200)
        b.demand(200)
        tick(a, sa, 100.0)
        tick(b, sb, 100.0)
        # Each alone on its device: both grow past half the budget, neither past it.
        assert a.limit * BPB > budget // 2 and b.limit * BPB > budget // 2, (a.calls, b.calls)
        assert max(a.limit, b.limit) * BPB <= budget
        assert (sa.status()["devices"], sb.status()["devices"]) == (["host memory node 0"], ["host memory node 1"])
        assert sa.others == [] and sb.others == []
        assert "shared budget 300KiB of host memory node 1, others hold 0B (none)" in sb._budget_text()
    finally:
        sa.close()
        sb.close()


def test_without_a_budget_the_status_names_no_device() -> None:
    scaler = new_autoscaler(Engine(), None)
    assert scaler.status()["devices"] is None and scaler._budget_text() == ""


# --- an in-process engine core: its timer decides between the caller's calls ----------


def test_the_timer_decides_only_while_no_call_holds_the_lock() -> None:
    engine = Engine()
    scaler = new_autoscaler(engine, None)
    lock = threading.RLock()
    decided = threading.Event()
    decisions: list[bool] = []

    def decide() -> None:
        # Each decision runs with the lock held by the timer's own thread.
        decisions.append(lock.acquire(blocking=False) and not lock.release())
        decided.set()

    with lock:  # a call in progress
        thread = wakeups.start_deciding(scaler, lock, decide)
        assert not decided.wait(5 * autoscaler.TICK_S) and decisions == []
    assert decided.wait(30 * autoscaler.TICK_S), "no decision once the call ended"
    scaler.close()
    thread.join(timeout=30 * autoscaler.TICK_S)
    assert not thread.is_alive() and decisions and all(decisions), decisions


def test_a_failing_decision_is_logged_and_the_timer_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    scaler = new_autoscaler(Engine(), None)
    lock = threading.RLock()
    calls: list[int] = []

    def decide() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a scheduler in an odd state")

    with caplog.at_level(logging.ERROR, logger="vllm.plugins.kv_cache_limit"):
        thread = wakeups.start_deciding(scaler, lock, decide)
        deadline = 100
        while len(calls) < 2 and deadline:
            threading.Event().wait(autoscaler.TICK_S)
            deadline -= 1
        scaler.close()
        thread.join(timeout=30 * autoscaler.TICK_S)
    assert len(calls) >= 2, calls
    assert "KV cache autoscaling failed while the engine idled" in caplog.text
    assert lock.acquire(blocking=False)  # released after the failure


def decision_in_progress(lock: Any, order: list[str], ends: Callable[[], str]) -> Callable[[], None]:
    """Start a thread that holds ``lock`` as a timer's decision would, until
    the returned function is called; it then appends ``ends()`` to
    ``order`` before releasing the lock, and the thread is joined."""
    deciding, release = threading.Event(), threading.Event()

    def decision() -> None:
        with lock:
            deciding.set()
            release.wait(30)
            order.append(ends())

    timer = threading.Thread(target=decision)
    timer.start()
    assert deciding.wait(30)

    def end() -> None:
        release.set()
        timer.join(30)

    return end


def test_a_client_call_waits_for_a_decision_in_progress() -> None:
    """``InprocClient``'s methods wrapped (``hooks.runtime.client``): with the
    engine core's lock held by a decision, a call starts only after it; an
    engine core without the lock (no autoscaling) is called at once."""
    from vllm_kv_cache_limit.hooks.runtime.client import _holding_engine_lock

    order: list[str] = []
    core = type("Core", (), {})()
    EngineCoreState.of(core).lock = threading.RLock()
    client = type("Client", (), {"engine_core": core})()
    call = _holding_engine_lock(lambda self, x: order.append(f"call {x}") or x)
    end_decision = decision_in_progress(EngineCoreState.of(core).lock, order, lambda: "decision ends")
    caller = threading.Thread(target=call, args=(client, 1))
    caller.start()
    caller.join(timeout=0.5)
    assert caller.is_alive() and order == [], order  # waiting for the decision
    end_decision()
    caller.join(30)
    assert order == ["decision ends", "call 1"], order
    plain = type("Client", (), {"engine_core": type("Core", (), {})()})()
    assert call(plain, 2) == 2 and order[-1] == "call 2"


def in_process_core(folder: Path) -> tuple[autoscaler.Autoscaler, Any, threading.RLock]:
    """An in-process engine core stand-in with an autoscaler in a ledger
    under ``folder`` and its autoscaling lock."""
    engine = Engine()
    scaler = started(engine, new_autoscaler(engine, 300 * BPB), folder)
    core = type("Core", (), {})()
    EngineCoreState.of(core).autoscaler = scaler
    lock = threading.RLock()
    EngineCoreState.of(core).lock = lock
    return scaler, core, lock


def test_shutdown_waits_for_a_decision_in_progress(tmp_path: Path) -> None:
    """vLLM's finalizer calls ``EngineCore.shutdown`` without the client's
    lock: the ledger is left only once the timer's decision has ended."""
    from vllm_kv_cache_limit.hooks.runtime.engine_core import _leave_budget_first

    scaler, core, lock = in_process_core(tmp_path)
    order: list[str] = []
    end_decision = decision_in_progress(lock, order, lambda: f"decision ends, ledgers {len(scaler.ledgers)}")
    shutdown = threading.Thread(target=_leave_budget_first(lambda core: order.append("vLLM's shutdown")), args=(core,))
    shutdown.start()
    shutdown.join(timeout=0.5)
    assert shutdown.is_alive() and order == [], order
    end_decision()
    shutdown.join(30)
    assert order == ["decision ends, ledgers 1", "vLLM's shutdown"], order
    assert scaler.ledgers == [] and lock.acquire(blocking=False)


def hold_ledger_lock(folder: Path) -> int:
    """Take the ledger's lock as any outside process could (the lock file
    is open to every user): returns the descriptor whose closing drops it."""
    import fcntl
    import os

    (ledger_dir,) = folder.glob("budget-*")
    fd = os.open(ledger_dir / "ledger.lock", os.O_RDONLY | os.O_NOFOLLOW)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_ledger_held_by_another_process_never_stalls_a_decision(
    pair, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The ledger's lock held from outside: a decision returns at once,
    keeping the limit the budget granted, says so once (not at every
    decision) and in the status, and decides again once the lock is free."""
    import os
    import time

    a, sa, b, sb, budget = pair
    a.demand(100)
    tick(a, sa, 100.0)
    granted = a.limit
    assert granted > sa.floor  # the premise: a limit the budget granted, above the floor
    fd = hold_ledger_lock(tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.plugins.kv_cache_limit"):
            a.demand(250)  # wants more
            # In a thread, so that a decision waiting on the lock fails the test instead of hanging it.
            decisions = threading.Thread(target=lambda: [tick(a, sa, 100.0 + step) for step in range(1, 21)])
            started = time.monotonic()
            decisions.start()
            decisions.join(timeout=10)
            assert not decisions.is_alive(), "a decision waited on the ledger's lock held by another process"
            took = time.monotonic() - started
            assert took < 5, f"20 decisions took {took:.1f} s with the ledger held"
            assert a.limit == granted, a.calls
            assert caplog.text.count("is locked by another process") == 1, caplog.text
            assert sa.status()["ledger_locked_s"] is not None
    finally:
        os.close(fd)
    with caplog.at_level(logging.INFO, logger="vllm.plugins.kv_cache_limit"):
        tick(a, sa, 200.0)
    assert a.limit > granted, a.calls  # the lock is free: the grow is decided
    assert "free again after" in caplog.text and "20 decisions kept the limit" in caplog.text, caplog.text
    assert sa.status()["ledger_locked_s"] is None
    assert (sa.held + sb.held) * BPB <= budget


def test_a_failure_at_every_decision_is_logged_once_per_episode(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine()
    scaler = new_autoscaler(engine, None)

    def broken(*args: Any) -> None:
        raise RuntimeError("a scheduler in an odd state")

    original = scaler.hysteresis.decide
    scaler.hysteresis.decide = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="vllm.plugins.kv_cache_limit"):
        for step in range(30):
            tick(engine, scaler, 100.0 + step)
        assert caplog.text.count("KV cache autoscaling failed in this step") == 1, caplog.text
        assert caplog.text.count("Traceback") == 1
        assert scaler.status()["failing_s"] is not None
        scaler.hysteresis.decide = original  # type: ignore[method-assign]
        tick(engine, scaler, 200.0)
    assert "works again after 30 failed decisions" in caplog.text, caplog.text
    assert scaler.status()["failing_s"] is None


def test_shutdown_never_closes_the_ledger_under_a_decision_that_outlasts_its_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decision longer than the shutdown's wait: vLLM's shutdown goes on,
    the ledger's descriptors stay open while the decision may still use
    them, and the timer closes them as the decision ends."""
    from vllm_kv_cache_limit.hooks.runtime import engine_core

    monkeypatch.setattr(engine_core, "SHUTDOWN_WAIT_S", 0.2)
    scaler, core, lock = in_process_core(tmp_path)
    deciding, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def decide() -> None:  # a long decision: it still uses the ledger when it ends
        deciding.set()
        release.wait(30)
        seen.append(len(scaler.ledgers) and scaler.ledgers[0].lock_fd)

    timer = wakeups.start_deciding(scaler, lock, decide)
    assert deciding.wait(30)
    order: list[str] = []
    engine_core._leave_budget_first(lambda core: order.append("vLLM's shutdown"))(core)
    assert order == ["vLLM's shutdown"]  # it did not wait for the decision
    assert len(scaler.ledgers) == 1 and scaler.ledgers[0].lock_fd >= 0  # nothing closed under it
    release.set()
    timer.join(timeout=30)
    assert not timer.is_alive()
    assert seen and seen[0] >= 0, seen  # the decision ended with the ledger still open
    assert scaler.ledgers == []  # ... and the timer left it then
    assert not list(tmp_path.glob("budget-*/*.entry"))


def test_a_grow_the_engine_refuses_leaves_the_ledger_as_it_was(pair, tmp_path: Path) -> None:
    """The ledger granted a grow, setting the limit failed: the entry holds
    what it held before, not the grow that never happened."""
    import json

    a, sa, b, sb, budget = pair
    held = sa.held
    refused: list[int] = []

    def set_limit(engine: Any, nbytes: int, mode: str, lazy: bool = False) -> dict[str, Any]:
        refused.append(nbytes // BPB)
        return {"error": "the workers did not answer"}

    sa.set_limit = set_limit
    a.demand(150)
    tick(a, sa, 100.0)
    assert refused and refused[0] > held  # the premise: a grow the budget granted was tried
    assert a.limit == sa.floor and sa.held == held, (a.limit, sa.held, held)
    entries = [json.loads(e.read_text()) for e in tmp_path.glob("budget-*/*.entry")]
    assert sorted(int(e["holds"]) for e in entries) == sorted([held * BPB, sb.held * BPB]), entries
