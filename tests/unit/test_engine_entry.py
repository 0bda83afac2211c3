"""The vLLM glue of the announcements (``hooks.runtime.engine_entry``) and the
server's part (``hooks.runtime.server``) without an engine: a capped engine
core's entry (static and autoscaled), the status URL written into it, the
entry removed before vLLM's shutdown, none without a cap, and the gauges
that carry vllm-kv-top's figures."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_kv_cache_limit.hooks.runtime import engine_entry, server  # noqa: E402
from vllm_kv_cache_limit.hooks.runtime.engine_core import _leave_budget_first  # noqa: E402
from vllm_kv_cache_limit.hooks.runtime.limit import EngineCoreState  # noqa: E402
from vllm_kv_cache_limit.logic import instance_entries  # noqa: E402
from vllm_kv_cache_limit.logic.limit_math import Allocation  # noqa: E402

pytestmark = pytest.mark.unit

MiB = 2**20
DEVICE = SimpleNamespace(key="cpu-node0", label="host memory node 0 (CPU backend)")


def config(cap: int | None) -> Any:
    return SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_max_memory=cap),
        model_config=SimpleNamespace(model="/models/tiny-llama", served_model_name=["tiny"]),
    )


@pytest.fixture(autouse=True)
def _devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_entry, "instance_devices", lambda vllm_config: ([DEVICE], 1))


def test_a_static_cap_is_announced_and_removed_before_vllms_shutdown(tmp_path: Path) -> None:
    core = type("Core", (), {})()
    engine_entry.start(core, config(32 * MiB), str(tmp_path))
    (found,) = instance_entries.read(str(tmp_path))
    assert found.record is not None
    assert (found.record["cap"], found.record["floor"], found.record["autoscale"]) == (32 * MiB, None, False)
    assert found.record["model"] == "tiny" and found.record["devices"][0]["key"] == "cpu-node0"
    assert engine_entry.set_status_url(core, "http://127.0.0.1:8000/kv_cache/max_memory") == {"announced": True}
    (found,) = instance_entries.read(str(tmp_path))
    assert found.record is not None and found.record["status_url"] == "http://127.0.0.1:8000/kv_cache/max_memory"
    seen_by_vllm: list[int] = []
    assert _leave_budget_first(lambda c: seen_by_vllm.append(len(instance_entries.read(str(tmp_path)))))(core) is None
    assert seen_by_vllm == [0] and EngineCoreState.of(core).announcement is None


def test_an_autoscaled_instance_announces_its_floor_and_budget(tmp_path: Path) -> None:
    core = type("Core", (), {})()
    allocation = Allocation(num_blocks=384, bytes_per_block=128 * 1024, blocks_per_request=16, max_model_len=2048)
    scaler = SimpleNamespace(allocation=allocation, floor=17, budget=40 * MiB)
    EngineCoreState.of(core).autoscaler = scaler  # type: ignore[assignment]
    engine_entry.start(core, config(48 * MiB), str(tmp_path))
    try:
        (found,) = instance_entries.read(str(tmp_path))
        assert found.record is not None
        assert (found.record["floor"], found.record["budget"], found.record["autoscale"]) == (
            17 * 128 * 1024,
            40 * MiB,
            True,
        )
    finally:
        engine_entry.stop(core)


def test_no_cap_no_entry_and_a_failure_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    core = type("Core", (), {})()
    engine_entry.start(core, config(None), str(tmp_path))
    assert not (tmp_path / instance_entries.FOLDER).exists()
    assert engine_entry.set_status_url(core, "http://x") == {"announced": False}
    (tmp_path / "file").write_text("")
    engine_entry.start(core, config(MiB), str(tmp_path / "file"))  # a lock folder that is a file
    assert EngineCoreState.of(core).announcement is None
    assert "not listed for vllm-kv-top" in caplog.text


@pytest.mark.parametrize(
    ("args", "url"),
    [
        ({"host": None, "port": 8000}, "http://127.0.0.1:8000/kv_cache/max_memory"),
        ({"host": "0.0.0.0", "port": 8000}, "http://127.0.0.1:8000/kv_cache/max_memory"),
        ({"host": "10.0.0.5", "port": 9000, "ssl_certfile": "c.pem"}, "https://10.0.0.5:9000/kv_cache/max_memory"),
        ({"host": "::", "port": 8000}, "http://[::1]:8000/kv_cache/max_memory"),
        ({"host": None, "port": 8000, "uds": "/run/vllm.sock"}, None),
    ],
)
def test_the_status_url_a_reader_on_the_host_uses(args: dict[str, Any], url: str | None) -> None:
    assert server.status_url(SimpleNamespace(**args)) == url


def test_one_status_sets_every_gauge() -> None:
    from prometheus_client import REGISTRY

    server._show_in_gauges(
        {
            "kv_cache_limit_bytes": 24 * MiB,
            "num_blocks_in_use": 7,
            "num_blocks_limit": 192,
            "autoscale": {"held_bytes": 24 * MiB, "floor_bytes": 2 * MiB, "shared_budget": 40 * MiB},
        }
    )
    values = {
        name: REGISTRY.get_sample_value(name)
        for name in (
            "vllm:kv_cache_limit_bytes",
            "vllm:kv_cache_held_bytes",
            "vllm:kv_cache_floor_bytes",
            "vllm:kv_cache_shared_budget_bytes",
            "vllm:kv_cache_blocks_in_use",
            "vllm:kv_cache_blocks_limit",
        )
    }
    assert values == {
        "vllm:kv_cache_limit_bytes": 24 * MiB,
        "vllm:kv_cache_held_bytes": 24 * MiB,
        "vllm:kv_cache_floor_bytes": 2 * MiB,
        "vllm:kv_cache_shared_budget_bytes": 40 * MiB,
        "vllm:kv_cache_blocks_in_use": 7,
        "vllm:kv_cache_blocks_limit": 192,
    }
