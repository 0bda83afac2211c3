"""Markers by folder: tests/unit -> unit, tests/e2e -> e2e, tests/gpu -> gpu,
tests/cuda_wheel -> cuda_wheel;
and what the folders share: the repository's root and the tiny model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
"""The time limit of an end-to-end test's own call (pytest-timeout,
``func_only``), so that a hung engine ends its test in minutes. Its
module's fixtures are bounded on their own: an engine's start-up by
``ENGINE_TIMEOUT_S``, the wait for the module lock by
``MODULE_LOCK_WAIT_S`` (``tests/e2e/conftest.py``); a wait for the lock
while the other worker runs an alone module is not a hang. A test that
needs longer says so with its own ``pytest.mark.timeout``. Unit tests keep
the project-wide limit (``timeout`` in pyproject.toml)."""


ALONE_MODULES = ("e2e/test_sharing.py", "e2e/test_autoscale.py", "e2e/test_kv_top.py")
"""End-to-end modules that run while no other end-to-end module does
(``_module_lock`` in ``tests/e2e/conftest.py``); ``make test`` gives them to
one worker, one after the other, while the other runs the unit tests.
``test_sharing`` makes exact premises on the memory node's free memory
(ballast grown to vLLM's own gate, the fit checks); ``test_autoscale`` loads
two servers bound to the two cores with 48 clients for minutes, which
starved an engine beside it; ``test_kv_top`` runs three servers bound to the
two cores, one of them loaded, and times how soon a killed one leaves the
view. ``test_cap`` is not one: its premises keep gigabytes of margin (a cap
of 40% of the node below what is free, one 16 MiB under the node's total
above it), more than another module's engines take, and each is asserted
where it is made; alone, it kept the other worker idle for 8 minutes."""


def xdist_group(path: str) -> str:
    """The group of a test file (relative to ``tests/``) under ``make test``
    (pytest-xdist): a module's tests run in one worker, with its
    module-scoped engines; the alone modules in one; the unit tests in one."""
    if path.startswith("unit/"):
        return "unit"
    if path in ALONE_MODULES:
        return "alone"
    return path


@pytest.hookimpl(optionalhook=True)  # xdist may be absent (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` by :func:`xdist_group`, read from each test's
    path (pytest-xdist's own groups ride on a node id suffix this pytest no
    longer reads). pytest-xdist hands out the groups with the most tests
    first: the unit tests (hundreds, no engine) and the alone modules start
    side by side, so the other worker waits least at its first end-to-end
    module."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModuleGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid.split("::", 1)[0].removeprefix("tests/"))

    return ByModuleGroup(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO / "tests").parts
        if parts and parts[0] in ("unit", "e2e", "gpu", "cuda_wheel"):
            item.add_marker(getattr(pytest.mark, parts[0]))
        if parts and parts[0] == "e2e" and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S, func_only=True))

        if UPSTREAM and item.get_closest_marker("plugin_only"):
            item.add_marker(pytest.mark.skip(reason="a plugin feature; not in the upstream patch"))


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each test leaves the process environment as it found it: plugin code
    run in the test process (a unit test's ``create_engine_config``, the
    error relay) sets its internal variables for its children, and one left
    behind would reach every engine a later test starts in this process
    (``make test`` runs unit and end-to-end tests in the same workers)."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The embedded tiny Llama under the repository, built once (shared with
    `make serve` and the benchmarks)."""
    from tests.tiny_model import build_tiny_model

    return str(build_tiny_model(REPO / REPO_MODEL_DIR))
