"""Markers by folder: tests/unit -> unit, tests/e2e -> e2e, tests/gpu -> gpu."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO / "tests").parts
        if parts and parts[0] in ("unit", "e2e", "gpu"):
            item.add_marker(getattr(pytest.mark, parts[0]))
