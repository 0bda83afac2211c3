"""docs/architecture.md is the one module map: it names every module of the
package, and nothing it names is gone; docstrings cite no vLLM line
numbers (version facts live in compat)."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

import vllm_kv_cache_limit

REPO = Path(__file__).resolve().parents[2]
MAP = REPO / "docs" / "architecture.md"
PACKAGE = Path(vllm_kv_cache_limit.__file__).parent


def modules() -> set[str]:
    """Every module of the package, as a path under it (``hooks/cap/ranks.py``)."""
    return {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}


def mapped() -> set[str]:
    """The modules the map in docs/architecture.md names, with their folders."""
    block = MAP.read_text().split("```")[1]
    found, stack = set(), []
    for line in block.splitlines()[2:]:  # past the package's own line
        match = re.match(r"( *)(\S+)", line)
        if not match or not (match.group(2).endswith(".py") or match.group(2).endswith("/")):
            continue
        depth = (len(match.group(1)) - 2) // 2
        name = match.group(2)
        del stack[depth:]
        if name.endswith("/"):
            stack.append(name)
            found.add("".join(stack) + "__init__.py")
        else:
            found.add("".join(stack) + name)
    return found


def test_the_map_names_every_module_and_no_other() -> None:
    assert mapped() == modules()


def test_the_map_can_fail() -> None:
    """The premise of the test above: it reads the tree, not a list."""
    assert "hooks/runtime/limit.py" in modules() and "logic/cap_decision.py" in modules()
    walked = pkgutil.walk_packages(vllm_kv_cache_limit.__path__, prefix="vllm_kv_cache_limit.")
    assert len(modules()) == len(list(walked)) + 1  # + the package's own __init__.py


def test_no_docstring_cites_vllm_line_numbers() -> None:
    cited = [
        f"{path.relative_to(PACKAGE)}: {match.group(0)}"
        for path in PACKAGE.rglob("*.py")
        for match in re.finditer(r"\b[\w/]+\.py:\d+", path.read_text())
    ]
    assert cited == [], "version facts belong in compat entries, not line numbers:\n" + "\n".join(cited)
