"""The planner's name, its error and how an error reads: one line.

Pure logic: no vLLM import.
"""

from __future__ import annotations

import contextlib

PROG = "vllm-kv-plan"
EXIT_ERROR = 2


class PlanError(Exception):
    """Bad input or a question vLLM cannot answer; reported as one line."""


def first_line(exc: BaseException) -> str:
    """The gist of an exception on one line (pydantic's validation errors
    put it on their second line)."""
    text = str(exc).strip() or type(exc).__name__
    errors = getattr(exc, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            text = str(errors()[0]["msg"]).strip().removeprefix("Value error, ")
    line = text.splitlines()[0] if text else type(exc).__name__
    # vLLM follows an unknown architecture with the list of all it knows.
    line = line.split(" Supported architectures:")[0]
    return line if len(line) <= 400 else line[:397] + "..."
