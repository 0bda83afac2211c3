"""vllm-kv-sim's scenarios beside ``even`` and ``autoscale`` (``no-cap``,
``plan``, ``oracle``), the device's memory and the MPS overlap factor, on
vLLM's real scheduler with the tiny Llama and the linear step time.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.unit.test_sim_core import BLOCK, LINEAR, MAX_MODEL_LEN, A, B, _setup  # noqa: E402
from vllm_kv_cache_limit.logic.sizes import parse_size  # noqa: E402
from vllm_kv_cache_limit.plan import make_plan  # noqa: E402
from vllm_kv_cache_limit.sim import memory, scenarios  # noqa: E402
from vllm_kv_cache_limit.sim.device import Device  # noqa: E402
from vllm_kv_cache_limit.sim.instance import InstanceSpec  # noqa: E402
from vllm_kv_cache_limit.sim.planned import _kv_cache, plan_caps  # noqa: E402
from vllm_kv_cache_limit.sim.traffic import Arrival  # noqa: E402

MiB = 1 << 20


def _bursts(at: float, count: int = 40) -> list[Arrival]:
    return [Arrival(at + i * 0.01, 400, 40) for i in range(count)]


def test_the_oracle_shares_one_pool_up_to_the_budget_at_every_step(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two instances burst at once, then one alone: the bytes of the blocks
    in use in both pools together never exceed the budget (checked after
    every step), reach it while both burst, and the lone burst takes far
    more than the even share at once (no floor, no decision delay)."""
    sums: list[tuple[float, int, list[int]]] = []
    real_sample = Device.sample

    def sample(self: Device) -> None:
        pools = [(i.core.scheduler.kv_cache_manager.block_pool, i.executor.bytes_per_block) for i in self.instances]
        used = [(p.num_gpu_blocks - p.free_block_queue.num_free_blocks) for p, _ in pools]
        sums.append((self.clock.now, sum(u * b for u, (_, b) in zip(used, pools)), used))
        real_sample(self)

    monkeypatch.setattr(Device, "sample", sample)
    setup = _setup(tiny_model, [_bursts(0.5) + _bursts(30.0), _bursts(0.5)], 200)
    bytes_per_block = setup.budget_bytes // 200
    result = scenarios.run("oracle", setup)
    assert len(sums) > 100
    assert max(total for _, total, _ in sums) <= setup.budget_bytes, max(sums, key=lambda s: s[1])
    assert max(total for _, total, _ in sums) >= setup.budget_bytes - 10 * bytes_per_block  # the bound binds
    alone = [used[0] for t, _, used in sums if t > 30.0]
    assert max(alone) > 150  # far above the even share (100) of the 200 blocks
    assert all(f["finished"] == f["requests"] for f in result["instances"].values())
    sums.clear()
    even = scenarios.run("even", setup)
    assert max(used[0] for t, _, used in sums if t > 30.0) <= 100
    assert result["instances"]["i0"]["e2e_s"]["p90"] < even["instances"]["i0"]["e2e_s"]["p90"]


def test_no_cap_sizes_as_vllm_and_the_second_instance_cannot_start(tiny_model: str) -> None:
    """vLLM's default (utilization 0.9) on a device of 100 MiB: the first
    instance's KV cache is 90 MiB less its weights and activations; the
    second finds 10 MiB free, less than the 90 MiB it asks for, and does not
    start (vLLM's error), so none of its requests is served. At 0.45 each
    both start, each with 45 MiB less its own."""
    setup = _setup(tiny_model, [_bursts(0.5, 10), _bursts(0.5, 10)], 200)
    footprints = [memory.Footprint(f"i{n}", 6 * MiB, 4 * MiB) for n in range(2)]
    setup.device_bytes, setup.footprints = 100 * MiB, footprints
    bytes_per_block = setup.budget_bytes // 200
    result = scenarios.run("no-cap", setup)
    first, second = result["instances"]["i0"], result["instances"]["i1"]
    assert first["kv_bytes"] == (int(100 * MiB * 0.9) - 10 * MiB) // bytes_per_block * bytes_per_block
    assert first["finished"] == first["requests"] == 10
    assert second["requests"] == 10 and second["finished"] == 0 and second["goodput_req_s"] == 0
    assert "Free memory on device" in second["error"] and "(0.9, 0.09 GiB)" in second["error"]
    setup.gpu_memory_utilization = 0.45
    both = scenarios.run("no-cap", setup)
    for name in ("i0", "i1"):
        figures = both["instances"][name]
        assert "error" not in figures and figures["finished"] == 10
        assert figures["kv_bytes"] == (int(100 * MiB * 0.45) - 10 * MiB) // bytes_per_block * bytes_per_block
    setup.gpu_memory_utilization, setup.footprints = 0.9, [memory.Footprint("i0", 95 * MiB, 0)] * 2
    assert "No available memory for the cache blocks" in scenarios.run("no-cap", setup)["instances"]["i0"]["error"]


def test_plan_gives_the_planners_caps_within_the_budget(tiny_model: str) -> None:
    """The caps are vllm-kv-plan's own for C requests of max_model_len each,
    together within the budget, and one more request for either would not fit."""
    specs = [InstanceSpec("a", tiny_model, MAX_MODEL_LEN, BLOCK), InstanceSpec("b", tiny_model, 1024, BLOCK)]
    budget = 8 * MiB
    caps = plan_caps(specs, budget)
    kvs = [_kv_cache(s.model, s.max_model_len, s.block_size, s.dtype) for s in specs]
    assert [cap for cap, _, _ in caps] == [make_plan(kv, c).suggested_bytes for kv, (_, c, _) in zip(kvs, caps)]
    assert sum(cap for cap, _, _ in caps) <= budget and all(c >= 1 for _, c, _ in caps)
    for index, kv in enumerate(kvs):
        more = make_plan(kv, caps[index][1] + 1).suggested_bytes
        assert sum(cap for cap, _, _ in caps) - caps[index][0] + more > budget
    setup = scenarios.Setup(specs, [_bursts(0.5, 5), _bursts(0.5, 5)], [LINEAR, LINEAR], budget)
    result = scenarios.run("plan", setup)
    for (cap, _, _), name in zip(caps, ("a", "b")):
        figures = result["instances"][name]
        assert figures["kv_bytes"] <= cap < figures["kv_bytes"] + kvs[0].bytes_per_block
        assert figures["finished"] == 5
    with pytest.raises(ValueError, match=r"--budget 1MiB .* give at least --budget"):
        plan_caps(specs, 1 * MiB)


def test_the_device_refuses_what_does_not_fit_and_suggests_a_budget_that_does(tiny_model: str) -> None:
    setup = _setup(tiny_model, [_bursts(0.5, 5), _bursts(0.5, 5)], 200)
    setup.device_bytes = 40 * MiB
    setup.footprints = [memory.Footprint(f"i{n}", 10 * MiB, 5 * MiB) for n in range(2)]
    setup.budget_bytes = 16 * MiB
    for name in ("even", "autoscale", "oracle"):
        with pytest.raises(memory.DeviceMemoryError) as refused:
            scenarios.run(name, setup)
        message = str(refused.value)
        assert "16MiB (16777216 bytes)" in message and "40MiB (41943040 bytes)" in message, message
        assert "weights 10MiB + activations 5MiB" in message
        suggested = message.split("at most --budget ")[1].split(" ")[0]
        assert parse_size(suggested) == 10 * MiB
    setup.budget_bytes = parse_size(suggested)
    assert scenarios.run("even", setup)["instances"]["i0"]["finished"] == 5
    setup.footprints = [memory.Footprint(f"i{n}", 30 * MiB, 0) for n in range(2)]
    with pytest.raises(memory.DeviceMemoryError, match="alone do not fit"):
        scenarios.run("even", setup)


@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_overlap_stretches_the_time_between_steps_as_stated(tiny_model: str, overlap: float) -> None:
    """Two instances decode one request each at the same time: each step
    holds the device for t * (1 - F/2) of its t = A + B, so each instance
    steps every 2t (F = 0, time-sharing), 1.5t (F = 0.5) or t (F = 1, as if
    alone): its TPOT."""
    one = [Arrival(0.0, 16, 200)]
    setup = _setup(tiny_model, [one, one], 200, overlap=overlap)
    result = scenarios.run("even", setup)
    step = A + B
    for name in ("i0", "i1"):
        tpot = result["instances"][name]["tpot_s"]["p50"]
        assert tpot == pytest.approx(step * (2 - overlap), rel=0.02), (name, tpot)
    with pytest.raises(ValueError, match=r"overlap 1.5: give a fraction from 0"):
        scenarios.run("even", _setup(tiny_model, [one], 200, overlap=1.5))


def test_weights_are_the_plugins_lower_bound_or_the_configs_estimate(tiny_model: str, tmp_path: Any) -> None:
    spec = InstanceSpec("a", tiny_model, 1024)
    found = memory.footprint(spec)
    # The tiny Llama: float32, 2 layers of 256 wide, 503 tokens of vocabulary, untied embeddings.
    params = 503 * 256 * 2 + 2 * (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 512 + 2 * 256) + 256
    assert found.weights == params * 4
    (tmp_path / "config.json").write_text((memory.Path(tiny_model) / "config.json").read_text())
    assert memory.footprint(InstanceSpec("b", str(tmp_path), 1024)).weights == params * 4  # no safetensors
    assert memory.footprint(spec, weights=7, activations=3).non_kv == 10
