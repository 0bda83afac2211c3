"""The block-pool side of run-time resize on vLLM's own ``BlockPool`` (no
engine): blocks above the limit leave the free queue, blocks freed above it
are withheld, usage is relative to the limit, and a grow gives them back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_kv_cache_limit import hooks, register
from vllm_kv_cache_limit.hooks.runtime.limit import EngineCoreState, RuntimeLimit
from vllm_kv_cache_limit.logic.limit_math import Allocation

BLOCKS = 10


@pytest.fixture
def pool():
    register()  # installs the hooks, BlockPool's wrappers included
    from vllm.v1.core.block_pool import BlockPool

    from vllm_kv_cache_limit.hooks.runtime import engine_core  # noqa: F401  (hooks.runtime.engine_core, whatever ran before

    return BlockPool(num_gpu_blocks=BLOCKS, enable_caching=True, hash_block_size=16)


def limit_of(pool, limit: int):
    allocation = Allocation(num_blocks=BLOCKS, bytes_per_block=1024, blocks_per_request=1, max_model_len=16)
    state = RuntimeLimit.attach(pool, allocation, pages=lambda keep, num_blocks, release, lazy: 0)
    state.limit = limit
    return state


def test_free_blocks_above_the_limit_leave_the_queue(pool) -> None:
    state = limit_of(pool, 4)
    state.withhold(pool.blocks[4:])
    assert pool.get_num_free_blocks() == 3  # blocks 1-3; block 0 is vLLM's null block
    assert sorted(b.block_id for b in pool.get_new_blocks(3)) == [1, 2, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_blocks_freed_above_the_limit_are_withheld(pool) -> None:
    held = pool.get_new_blocks(BLOCKS - 1)  # every block in use
    state = limit_of(pool, 4)
    pool.free_blocks([b for b in held if b.block_id in (5, 6)])
    assert pool.get_num_free_blocks() == 0 and state.withheld == {5, 6}
    pool.free_blocks([b for b in held if b.block_id == 2])
    assert pool.get_num_free_blocks() == 1
    assert pool.get_usage() == pytest.approx(1 - 1 / 3)  # 3 usable blocks under the limit


def test_without_a_limit_vllm_is_untouched(pool) -> None:
    held = pool.get_new_blocks(BLOCKS - 1)
    pool.free_blocks(held[:4])
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == pytest.approx(1 - 4 / 9)


def test_grow_gives_withheld_blocks_back(pool) -> None:
    state = limit_of(pool, 4)
    state.withhold(pool.blocks[4:])
    state.limit = 7
    state.grow()
    assert state.withheld == {7, 8, 9}
    assert sorted(b.block_id for b in pool.get_new_blocks(6)) == [1, 2, 3, 4, 5, 6]


def test_the_prefix_cache_resets_under_a_limit_and_the_blocks_above_stay_withheld(pool) -> None:
    """vLLM resets the prefix cache only when every block but the null one
    is free; withheld blocks count as free for it, and stay withheld."""
    held = pool.get_new_blocks(BLOCKS - 1)
    pool.free_blocks(held)
    state = limit_of(pool, 4)
    state.withhold(pool.blocks[4:])
    assert state.withheld == {4, 5, 6, 7, 8, 9} and pool.get_num_free_blocks() == 3
    pool.blocks[2].set_block_hash(b"cached")  # a block in the prefix cache, below the limit
    assert pool.reset_prefix_cache() is True
    assert pool.blocks[2].block_hash is None
    assert state.withheld == {4, 5, 6, 7, 8, 9} and pool.get_num_free_blocks() == 3
    assert sorted(b.block_id for b in pool.get_new_blocks(3)) == [1, 2, 3]
    # A block in use still makes vLLM refuse, as without a limit, and nothing moves.
    assert pool.reset_prefix_cache() is False
    assert state.withheld == {4, 5, 6, 7, 8, 9} and pool.get_num_free_blocks() == 0


def test_a_failing_reset_leaves_the_blocks_above_withheld(pool, monkeypatch) -> None:
    state = limit_of(pool, 4)
    state.withhold(pool.blocks[4:])
    block_class = type(pool.blocks[0])
    reset_hash = block_class.reset_hash

    def fails_at_block_5(block) -> None:  # a failure inside vLLM's reset, with the blocks above queued
        if block.block_id == 5:
            raise ZeroDivisionError("inside vLLM's reset")
        reset_hash(block)

    monkeypatch.setattr(block_class, "reset_hash", fails_at_block_5)
    with pytest.raises(ZeroDivisionError):
        pool.reset_prefix_cache()
    assert state.withheld == {4, 5, 6, 7, 8, 9} and pool.get_num_free_blocks() == 3


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


class _FailingEngineCore:
    """An engine core with vLLM's real block pool, one running request
    holding blocks above the new limit, and a scheduler whose preemption
    raises (as a vLLM bug or an unexpected request state would)."""

    def __init__(self, pool, held: list) -> None:
        from types import SimpleNamespace

        request = SimpleNamespace(request_id="r0")
        ids = [b.block_id for b in held]
        manager = SimpleNamespace(block_pool=pool, get_blocks=lambda request_id: _Blocks(ids))

        def preempt(*args, **kwargs):
            raise RuntimeError("preemption broke")

        # vLLM's CPU build: no extensible KV cache
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(enable_extensible_kv_cache=False))
        self.scheduler = SimpleNamespace(
            kv_cache_manager=manager,
            running=[request],
            prev_step_scheduled_req_ids=set(),
            _preempt_request=preempt,
        )
        self.model_executor = SimpleNamespace(collective_rpc=lambda *args, **kwargs: [0])


def test_a_change_that_fails_inside_vllm_is_rolled_back(pool) -> None:
    from vllm_kv_cache_limit.logic.errors import KVCacheResizeFailed

    held = pool.get_new_blocks(BLOCKS - 1)
    pool.free_blocks([b for b in held if b.block_id not in (6, 7)])  # the request keeps blocks 6 and 7
    free_before = sorted(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    assert free_before == [1, 2, 3, 4, 5, 8, 9]
    core = _FailingEngineCore(pool, [pool.blocks[6], pool.blocks[7]])
    EngineCoreState.of(core).allocation = Allocation(
        num_blocks=BLOCKS, bytes_per_block=1024, blocks_per_request=1, max_model_len=16
    )

    result = hooks.runtime.utility_methods.kv_cache_limit_set(core, 4 * 1024, "preempt")

    assert result.get("failed") is True and "preemption broke" in result["error"], result
    assert "stays at 10KiB (10 blocks)" in result["error"], result["error"]
    with pytest.raises(KVCacheResizeFailed, match="preemption broke"):
        hooks.runtime.client._checked(result)
    state = RuntimeLimit.of(pool)
    assert (state.limit, state.requested, state.mode, state.withheld) == (BLOCKS, BLOCKS * 1024, "drain", set())
    assert sorted(b.block_id for b in pool.free_block_queue.get_all_free_blocks()) == free_before
    # And the engine resizes normally afterwards (drain: the request keeps its blocks).
    status = hooks.runtime.utility_methods.kv_cache_limit_set(core, 4 * 1024, "drain")
    assert "error" not in status and status["num_blocks_limit"] == 4 and status["num_blocks_in_use_above_limit"] == 2


def test_a_ceiling_whose_limit_fails_is_not_kept(pool) -> None:
    """Autoscaling: a manual resize below the limit in force sets the
    limit, then the ceiling; when the limit cannot be set, the ceiling
    stays as it was."""
    from vllm_kv_cache_limit.hooks.runtime import autoscaler, utility_methods
    from vllm_kv_cache_limit.logic.autoscale_policy import Hysteresis, Policy

    allocation = Allocation(num_blocks=BLOCKS, bytes_per_block=1024, blocks_per_request=1, max_model_len=16)
    limit_of(pool, BLOCKS)
    held = pool.get_new_blocks(BLOCKS - 1)
    pool.free_blocks([b for b in held if b.block_id not in (6, 7)])
    core = _FailingEngineCore(pool, [pool.blocks[6], pool.blocks[7]])
    state = EngineCoreState.of(core)
    state.allocation = allocation
    state.autoscaler = autoscaler.Autoscaler(
        allocation=allocation,
        hysteresis=Hysteresis(Policy(2, 1, shrink_after_s=30.0)),
        ceiling=BLOCKS,
        set_limit=utility_methods.set_limit,
        group_caps=[(16, 1)],
        max_model_len=16,
    )
    result = utility_methods.kv_cache_limit_set(core, 4 * 1024, "preempt")
    assert result.get("failed") is True and "preemption broke" in result["error"], result
    assert state.autoscaler.ceiling == BLOCKS  # not the refused 4
    assert RuntimeLimit.of(pool).limit == BLOCKS
    # Once the limit can be set, the ceiling follows, and the reply shows it.
    status = utility_methods.kv_cache_limit_set(core, 4 * 1024, "drain")
    assert "error" not in status and status["num_blocks_limit"] == 4, status
    assert state.autoscaler.ceiling == 4 and status["autoscale"]["ceiling_bytes"] == 4 * 1024, status


class _CoreClient:
    """vLLM's engine-core client as the routes see it: one utility call, one reply."""

    def __init__(self, reply: dict) -> None:
        self.reply = reply
        self.calls: list[tuple] = []
        self.core_engines = [b"\x00\x00"]  # vLLM's MPClient: one engine core's identity

    async def call_utility_async(self, method: str, *args):
        self.calls.append((method, *args))
        return self.reply


@pytest.mark.parametrize(
    ("reply", "code", "kind"),
    [
        (
            {"error": "Changing the KV cache limit to 4KiB failed inside vLLM", "failed": True},
            500,
            "InternalServerError",
        ),
        ({"error": "Cannot lower the KV cache limit to 4KiB"}, 400, "BadRequestError"),
    ],
)
def test_route_answers_a_failure_inside_vllm_with_500_and_bad_input_with_400(reply, code: int, kind: str) -> None:
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_kv_cache_limit.hooks.runtime import server

    register()
    app = FastAPI()
    app.include_router(server._router(SimpleNamespace(api_key=["k"], kv_cache_max_memory=None)))
    core = _CoreClient(reply)
    app.state.engine_client = SimpleNamespace(engine_core=core)
    answer = TestClient(app).post(
        hooks.runtime.server.ROUTE, json={"size": "4K", "mode": "preempt"}, headers={"Authorization": "Bearer k"}
    )
    assert answer.status_code == code, answer.text
    assert answer.json()["error"] == {"message": reply["error"], "type": kind, "param": None, "code": code}
    assert core.calls == [("kv_cache_limit_set", 4096, "preempt")]


class _ShuttingDownClient(_CoreClient):
    """vLLM's client while its engine core shuts down: the engine core
    rejects every utility call, and the client raises its failure message."""

    async def call_utility_async(self, method: str, *args):
        self.calls.append((method, *args))
        raise Exception("Server shutting down")


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_route_answers_an_engine_that_cannot_answer_with_503(method: str) -> None:
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_kv_cache_limit.hooks.runtime import server

    register()
    app = FastAPI()
    app.include_router(server._router(SimpleNamespace(api_key=["k"], kv_cache_max_memory=None)))
    core = _ShuttingDownClient({})
    app.state.engine_client = SimpleNamespace(engine_core=core)
    body = {"json": {"size": "4K", "mode": "drain"}} if method == "POST" else {}
    answer = TestClient(app).request(method, hooks.runtime.server.ROUTE, headers={"Authorization": "Bearer k"}, **body)
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503, error
    assert "Server shutting down" in error["message"] and "try again" in error["message"], error
    assert len(core.calls) == 1


def _preempting_scheduler(preempt) -> SimpleNamespace:
    """A scheduler whose one running request holds block 7, above a limit of 4."""
    request = SimpleNamespace(request_id="r0")
    manager = SimpleNamespace(get_blocks=lambda request_id: _Blocks([1, 7]))
    return SimpleNamespace(
        kv_cache_manager=manager, running=[request], prev_step_scheduled_req_ids={"r0"}, _preempt_request=preempt
    )


def test_preemption_that_fails_with_a_type_error_is_not_retried() -> None:
    """A TypeError raised inside vLLM after part of the preemption ran must
    reach the caller (which rolls the change back), not trigger a second
    preemption of the same request with other arguments."""
    calls = []

    def preempt(request, timestamp, **kwargs):
        calls.append((request.request_id, kwargs))
        raise TypeError("unsupported operand type(s) inside vLLM's preemption")

    scheduler = _preempting_scheduler(preempt)
    with pytest.raises(TypeError, match="inside vLLM"):
        hooks.runtime.limit.preempt_above(scheduler, 4)
    assert calls == [("r0", {"drop_stale_output": True})]  # once, with this vLLM's signature


def test_preemption_passes_only_the_parameters_this_vllm_has(monkeypatch) -> None:
    calls = []
    scheduler = _preempting_scheduler(lambda request, timestamp, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(hooks.runtime.limit, "_preempt_drops_stale_output", lambda: False)  # vLLM 0.29-0.31
    hooks.runtime.limit.preempt_above(scheduler, 4)
    assert calls == [{}] and scheduler.running == [] and scheduler.prev_step_scheduled_req_ids == set()
