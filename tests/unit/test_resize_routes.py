"""The HTTP routes of run-time resize as a client meets them (FastAPI's own
app and test client, the engine-core client the only stand-in): a POST the
server does not serve is absent (404, as for any route vLLM lacks), and a
body is checked whole, its errors quoting JSON as it was sent."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_kv_cache_limit import register

STATUS = {"holds": True, "kv_cache_limit_bytes": 4096, "num_blocks_in_use": 0, "num_blocks_limit": 4}


class _CoreClient:
    """vLLM's engine-core client as the routes see it: one utility call, one reply."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.core_engines = [b"\x00\x00"]  # vLLM's MPClient: one engine core's identity

    async def call_utility_async(self, method: str, *args: Any) -> dict:
        self.calls.append((method, *args))
        return STATUS


def _client(enable: bool, autoscale: bool) -> tuple[Any, _CoreClient]:
    """A server app built through the plugin's ``build_app`` wrapper, as
    ``vllm serve`` builds it with these two flags."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_kv_cache_limit.hooks.runtime import server

    register()
    args = SimpleNamespace(
        api_key=None, kv_cache_max_memory=None, enable_kv_cache_resize=enable, kv_cache_autoscale=autoscale
    )
    app = server._add_routes(lambda args: FastAPI())(args)
    core = _CoreClient()
    app.state.engine_client = SimpleNamespace(engine_core=core)
    return TestClient(app), core


def test_post_without_the_flag_is_absent_on_an_autoscaled_server() -> None:
    """``--kv-cache-autoscale`` serves GET alone: a POST answers 404, as a
    route vLLM lacks does, and says which flag serves it."""
    client, core = _client(enable=False, autoscale=True)
    assert client.get("/kv_cache/max_memory").status_code == 200  # the premise: the route serves GET
    answer = client.post("/kv_cache/max_memory", json={"size": "4K"})
    assert answer.status_code == 404, answer.text
    assert "--enable-kv-cache-resize" in answer.json()["error"]["message"]
    assert [call[0] for call in core.calls] == ["kv_cache_limit_status"]  # nothing changed


def test_no_route_at_all_without_either_flag() -> None:
    client, core = _client(enable=False, autoscale=False)
    assert client.get("/kv_cache/max_memory").status_code == 404
    assert client.post("/kv_cache/max_memory", json={"size": "4K"}).status_code == 404
    assert core.calls == []


@pytest.mark.parametrize(
    ("body", "quoted"),
    [
        ({"size": "4K", "mdoe": "preempt"}, '"mdoe"'),
        ({"sise": "4K"}, '"sise"'),
        ({"size": "4K", "timeout": 5}, '"timeout"'),
    ],
)
def test_unknown_keys_are_refused_naming_them_and_the_accepted_keys(body: dict, quoted: str) -> None:
    client, core = _client(enable=True, autoscale=False)
    answer = client.post("/kv_cache/max_memory", json=body)
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert quoted in message and '"size", "mode", "timeout_s"' in message, message
    assert core.calls == []  # the engine was not asked


@pytest.mark.parametrize(
    ("body", "quoted"),
    [
        ({"size": True}, "true"),
        ({"size": None}, "null"),
        ({"size": "4K", "mode": False}, "false"),
        ({"size": "4K", "timeout_s": "soon"}, '"soon"'),
        ({"size": "lots"}, '"lots"'),
        ([{"size": "4K"}], '[{"size": "4K"}]'),
        ("4K", '"4K"'),
    ],
)
def test_errors_quote_the_body_as_json(body: Any, quoted: str) -> None:
    client, core = _client(enable=True, autoscale=False)
    answer = client.post("/kv_cache/max_memory", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert quoted in message, message
    for python in ("True", "False", "None", "'"):
        assert python not in message.split("for example")[0], message
    assert core.calls == []


def test_a_good_body_reaches_the_engine() -> None:
    client, core = _client(enable=True, autoscale=False)
    answer = client.post("/kv_cache/max_memory", json={"size": "4K", "mode": "preempt", "timeout_s": 0})
    assert answer.status_code == 200, answer.text
    assert core.calls == [("kv_cache_limit_set", 4096, "preempt")]
