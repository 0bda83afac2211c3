"""One cap decision for every rank of an engine, so that all raise the same
error or none does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError
from vllm_kv_cache_limit.logic.relay import raise_cap_error


def decide_together(step: Callable[[], Any]) -> Any:
    """Run ``step`` (a cap check, possibly with vLLM's profiling) on every
    rank and share the outcome, so that every rank raises the same cap error
    or none does, and a rank where vLLM itself failed does not leave the
    others waiting. A rank that raised alone would leave the others waiting
    forever in the next collective (the executor reads replies rank by rank
    with no timeout)."""
    outcome: tuple[str, str] | None = None
    failure: Exception | None = None
    result = None
    try:
        result = step()
    except KVCacheMaxMemoryError as exc:
        outcome, failure = ("cap", str(exc)), exc
    except Exception as exc:
        outcome, failure = ("other", f"{type(exc).__name__}: {exc}"), exc
    found = _first_failure_of_all_ranks(outcome)
    if found is None:
        return result
    rank, (kind, message) = found
    if kind == "cap":
        raise_cap_error(message if outcome == (kind, message) else f"{message} (found by worker rank {rank})")
    if failure is not None:
        raise failure
    raise RuntimeError(f"worker rank {rank} failed while sizing the KV cache: {message}")


def _first_failure_of_all_ranks(outcome: tuple[str, str] | None) -> tuple[int, tuple[str, str]] | None:
    """All ranks of this engine exchange their outcome (None when fine) over
    vLLM's CPU world group; returns the same (rank, outcome) on every rank:
    the lowest rank's cap error, else the lowest rank's other failure."""
    import torch.distributed as dist

    gathered: list[tuple[str, str] | None] = [outcome]
    if dist.is_initialized():
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        if group.world_size > 1:
            gathered = [None] * group.world_size
            dist.all_gather_object(gathered, outcome, group=group.cpu_group)
    for kind in ("cap", "other"):
        for rank, found in enumerate(gathered):
            if found is not None and found[0] == kind:
                return rank, (found[0], found[1])
    return None


GET_WORLD_GROUP = Hook(("vllm.distributed.parallel_state",), "get_world_group")

HOOKS = (GET_WORLD_GROUP,)
"""Called, not wrapped."""

TARGETS: dict[str, Callable[[Any], None]] = {}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
