"""Markers by folder: tests/unit -> unit, tests/e2e -> e2e, tests/gpu -> gpu,
tests/cuda_wheel -> cuda_wheel;
and what the folders share: the repository's root and the tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiny_model import REPO_MODEL_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
TEST_MAX_MODEL_LEN = 512
"""The engines' max_model_len in the end-to-end and GPU tests."""

UPSTREAM = os.environ.get("KV_CACHE_LIMIT_TARGET") == "upstream"
"""The tests run against vLLM patched with ``upstream/`` and without the
plugin (``make test-upstream``): the same checks of the cap, those of
features the patch leaves out (``plugin_only``) skipped."""

REFERENCE_PYTHON = os.environ.get("KV_CACHE_LIMIT_REFERENCE_PYTHON") or None
"""Under ``UPSTREAM``: the interpreter of the same vLLM release unpatched
(the plugin excluded with ``VLLM_PLUGINS=""``), what "unchanged" is compared
with."""


E2E_TIMEOUT_S = 420
"""The time limit of an end-to-end test (pytest-timeout; its module's
engines' start-up included when it is the first to need them), so that a
hung engine ends its test in minutes. The few load tests that need longer
say so with their own ``pytest.mark.timeout``. Unit tests keep the
project-wide limit (``timeout`` in pyproject.toml)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO / "tests").parts
        if parts and parts[0] in ("unit", "e2e", "gpu", "cuda_wheel"):
            item.add_marker(getattr(pytest.mark, parts[0]))
        if parts and parts[0] == "e2e" and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))
        if UPSTREAM and item.get_closest_marker("plugin_only"):
            item.add_marker(pytest.mark.skip(reason="a plugin feature; not in the upstream patch"))


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The embedded tiny Llama under the repository, built once (shared with
    `make serve` and the benchmarks)."""
    from tests.tiny_model import build_tiny_model

    return str(build_tiny_model(REPO / REPO_MODEL_DIR))
