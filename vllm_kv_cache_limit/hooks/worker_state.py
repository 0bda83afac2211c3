"""All the plugin keeps in one worker process, in one object: ``WorkerState``.

The hooks on the worker's side receive different vLLM objects of the same
worker: the worker itself, its ``VllmConfig``, that config's cache and
compilation configs, vLLM 0.34's extensible KV cache. Each gets the same
``WorkerState`` under one name (``_kvcl_worker``), attached where a hook
holds several of them, so that a hook given any one finds it. An engine
built later in the same process has configs (and workers, caches) of its
own, so it starts with no state: nothing leaks from one engine to the next.

The chunk plan of the extensible cache's buffer is not kept here but on the
buffer (``hooks.runtime.extensible_tensor.BufferChunks``): it describes that
buffer's mapping (its segments, the driver handles it still has to release),
the hook that maps by it receives only the buffer, and a buffer vLLM builds
again must start without the old one's plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_kv_cache_limit.logic.budget_ledger import Companions
from vllm_kv_cache_limit.logic.cap_decision import CapDecision

ATTRIBUTE = "_kvcl_worker"
"""The one attribute each worker-side vLLM object holds the state under."""


@dataclasses.dataclass
class Gate:
    """What vLLM's start-up gate asked for in this worker process."""

    device: str
    total: int
    free: int
    """Free memory at the first snapshot."""
    requested: int
    """What the worker finally requested (vLLM's budget before non-KV memory)."""
    limited_by_free: bool
    """Whether free memory, not ``--gpu-memory-utilization``, set ``requested``."""


@dataclasses.dataclass
class WorkerState:
    """All the plugin keeps for one worker (as ``_kvcl_worker`` on its vLLM objects)."""

    gate: Gate | None = None
    """Under a cap: what vLLM's start-up gate asked for (``hooks.cap.worker_gate``)."""
    cap_decision: CapDecision | None = None
    """Under a cap: the cap and this worker's budget after vLLM's profiling,
    read where vLLM resolves the CUDA graph sizes (``hooks.cap.compilation``)."""
    rss_fall: int = 0
    """Bytes the worker's RSS (less LazyFree, for a lazy release) fell by at
    its last release of KV cache pages (``hooks.runtime.worker``)."""
    measured: int | None = None
    """Extensible cache, under a cap: the blocks vLLM measured room for after
    warmup; the worker commits no more at start-up."""
    started: int | None = None
    """Extensible cache, under a cap: the blocks committed at start-up (None:
    not extended yet; the cache's capacity then bounds a raise)."""
    refusal: str | None = None
    """Extensible cache: why it was not mapped in chunks (a feature or
    layout that needs the whole mapping); None where it was, or no cap."""
    hint: str | None = None
    """What the user can do about ``refusal``."""
    said_stays: bool = False
    """Whether the line saying a lower limit returns no GPU memory was logged."""
    companions: Companions | None = None
    """With a shared budget: the companions of the instance's ledger entries
    this worker holds locked until it exits (``hooks.runtime.worker``)."""

    @classmethod
    def of(cls, *holders: Any) -> WorkerState:
        """The state kept on any of ``holders`` (the first found), or a new
        one; attached to each of them."""
        state = next((found for holder in holders if (found := cls.peek(holder)) is not None), None)
        if state is None:
            state = cls()
        for holder in holders:
            setattr(holder, ATTRIBUTE, state)
        return state

    @classmethod
    def of_config(cls, vllm_config: Any, *holders: Any) -> WorkerState:
        """``of`` the worker's ``vllm_config``, its cache and compilation
        configs, and ``holders``."""
        return cls.of(*holders, vllm_config, vllm_config.cache_config, vllm_config.compilation_config)

    @classmethod
    def peek(cls, holder: Any) -> WorkerState | None:
        """The state kept on ``holder``, without creating one."""
        return getattr(holder, ATTRIBUTE, None)
