"""vllm.utils.extensible_tensor: map a capped extensible KV cache in chunks
that a run-time limit can release whole (vLLM 0.34+)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.hooks.runtime.availability import RESIZE_REMOVE, optional
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic.vmm_chunks import ChunkPlan

UPSTREAM = "none yet: ExtensibleTensor is grow-only and maps each committed run as one driver allocation"


def patch(module: Any) -> None:
    """Why: the driver unmaps only whole mappings, and vLLM maps each run it
    commits as one; a run cut at whole-block boundaries lets the chunks above
    a lowered limit go while the blocks below keep their memory. How: wraps
    ``_VirtualBuffer._map_chunk_at``; on a buffer given a chunk plan
    (``hooks.runtime.extensible_kv_cache``) it maps the run as the plan's
    pieces, each through vLLM's original, and on a failure unmaps and
    releases the pieces this call mapped before it raises. Any other buffer:
    the original alone."""
    optional(MAP_CHUNK_AT, functools.partial(wrap, module._VirtualBuffer, "_map_chunk_at", _in_chunks))


@dataclasses.dataclass
class BufferChunks:
    """All the plugin keeps on one of vLLM's ``_VirtualBuffer``s (as
    ``_kvcl_chunks``): it describes that buffer's mapping, so it stays with
    the buffer, not in the worker's state (``hooks.worker_state``)."""

    plan: ChunkPlan
    """The chunks the buffer's runs are mapped as."""
    unreleased: list[int] = dataclasses.field(default_factory=list)
    """Driver handles unmapped but not yet released (a driver failure
    between the two); the next ``unmap`` releases them first."""


def buffer_chunks(buffer: Any) -> BufferChunks | None:
    """What the plugin keeps on a buffer given a chunk plan (None: none given)."""
    return getattr(buffer, "_kvcl_chunks", None)


def plan_of(buffer: Any) -> ChunkPlan | None:
    """The chunk plan a buffer was given, if any."""
    chunks = buffer_chunks(buffer)
    return None if chunks is None else chunks.plan


def give_plan(buffer: Any, plan: ChunkPlan) -> None:
    """Map the buffer's runs by ``plan`` from now on (handles still to
    release stay listed)."""
    chunks = buffer_chunks(buffer)
    if chunks is None:
        buffer._kvcl_chunks = BufferChunks(plan)
    else:
        chunks.plan = plan


def unmap(buffer: Any, entries: list[tuple[int, int, int]]) -> None:
    """Unmap and release the ``(handle, offset, size)`` chunks of a buffer
    given a chunk plan and forget them (its handles and mapped granules), as vLLM's
    ``release_physical`` does for all of them. Each is forgotten once it is
    unmapped, so that after a driver failure the buffer still names every
    chunk mapped and a later call can return them; a handle unmapped but
    not released is released first by the next call."""
    driver = buffer._driver
    chunks = buffer_chunks(buffer)
    if chunks is None:
        raise RuntimeError("the plugin unmaps chunks only of a buffer it gave a chunk plan")
    unreleased = chunks.unreleased
    while unreleased:
        driver.release(unreleased[0])
        unreleased.pop(0)
    for entry in entries:
        handle, offset, size = entry
        driver.unmap(buffer.base_ptr + offset, size)
        buffer._handles.remove(entry)
        buffer._mapped_granules.difference_update(
            range(offset // buffer.granularity, (offset + size) // buffer.granularity)
        )
        unreleased.append(handle)
        driver.release(handle)
        unreleased.pop()


def _in_chunks(original: Callable) -> Callable:
    def _map_chunk_at(self: Any, offset: int, size: int) -> None:
        plan = plan_of(self)
        if plan is None:
            return original(self, offset, size)
        before = len(self._handles)
        try:
            for piece_offset, piece_size in plan.pieces(offset, size):
                original(self, piece_offset, piece_size)
        except BaseException:
            unmap(self, self._handles[before:])
            raise
        return None

    return _map_chunk_at


MAP_CHUNK_AT = Hook(
    ("vllm.utils.extensible_tensor",),
    "_VirtualBuffer._map_chunk_at",
    ("self", "offset", "size"),
    versions=">=0.34",
    wrapper=_in_chunks,
    upstream=UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

# Called, not wrapped: returning the chunks above a limit (``unmap``) and
# committing up to it again.
VIRTUAL_BUFFER_ENSURE_COMMITTED_RANGE = Hook(
    ("vllm.utils.extensible_tensor",),
    "_VirtualBuffer.ensure_committed_range",
    ("self", "start", "end"),
    versions=">=0.34",
)

VMM_DRIVER_UNMAP = Hook(("vllm.utils.vmm_driver",), "VmmDriver.unmap", ("self", "ptr", "size"), versions=">=0.34")
VMM_DRIVER_RELEASE = Hook(("vllm.utils.vmm_driver",), "VmmDriver.release", ("self", "handle"), versions=">=0.34")

HOOKS = (MAP_CHUNK_AT, VIRTUAL_BUFFER_ENSURE_COMMITTED_RANGE, VMM_DRIVER_UNMAP, VMM_DRIVER_RELEASE)

TARGETS = {"vllm.utils.extensible_tensor": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
