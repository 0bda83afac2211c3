"""The ``plan`` scenario's static caps: what ``vllm-kv-plan`` recommends for
these instances within the budget.

For each instance the planner (its own code: ``load_model_kv_cache``,
``make_plan``) gives the ``--kv-cache-max-memory`` that holds C requests of
its ``max_model_len`` at once. Every instance starts at C = 1; then, in
turn, each one's C goes up by one while the recommended caps together stay
within the budget. The caps are the planner's tidy sizes, so they may
leave part of the budget unused.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from typing import Any

from vllm_kv_cache_limit.logic.sizes import format_size
from vllm_kv_cache_limit.plan import build_parser, load_model_kv_cache, make_plan
from vllm_kv_cache_limit.plan.introspect import quiet_vllm
from vllm_kv_cache_limit.sim.aiconfigurator import model_folder
from vllm_kv_cache_limit.sim.instance import SimulationError


@functools.lru_cache(maxsize=32)
def _kv_cache(model: str, max_model_len: int, block_size: int, dtype: str) -> Any:
    argv = [model, "--max-model-len", str(max_model_len), "--block-size", str(block_size), "--dtype", dtype]
    args: argparse.Namespace = build_parser().parse_args(argv)
    with quiet_vllm(False):
        return load_model_kv_cache(args)


def plan_caps(specs: Sequence[Any], budget_bytes: int) -> list[tuple[int, int, str]]:
    """Each instance's (cap in bytes, concurrency, the planner's size text), the caps together within the budget."""
    # A Hugging Face name with a config aiconfigurator-core ships: the folder holding only it (offline).
    kvs = [_kv_cache(model_folder(s.model) or s.model, s.max_model_len, s.block_size, s.dtype) for s in specs]
    plans = [make_plan(kv, 1) for kv in kvs]
    total = sum(p.suggested_bytes for p in plans)
    if total > budget_bytes:
        least = ", ".join(f"{s.name} {p.suggested}" for s, p in zip(specs, plans))
        raise SimulationError(
            f"scenario plan: --budget {format_size(budget_bytes)} ({budget_bytes} bytes) is less than the "
            f"planner's caps for one request of max_model_len each ({least}: {format_size(total, 'up')}); "
            f"give at least --budget {format_size(total, 'up')}."
        )
    grew = True
    while grew:
        grew = False
        for index, kv in enumerate(kvs):
            bigger = make_plan(kv, plans[index].concurrency + 1)
            if total - plans[index].suggested_bytes + bigger.suggested_bytes <= budget_bytes:
                total += bigger.suggested_bytes - plans[index].suggested_bytes
                plans[index] = bigger
                grew = True
    return [(p.suggested_bytes, p.concurrency, p.suggested) for p in plans]
