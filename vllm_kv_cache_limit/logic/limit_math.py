"""Run-time resize of the KV cache limit: the arithmetic, without vLLM.

The memory allocated at start-up (the start-up cap, or vLLM's budget without
one) is the most a run-time limit can reach. Within it the limit is a block
count: blocks ``[0, limit)`` stay usable (block 0 is vLLM's null block, as in
its own ``num_gpu_blocks``), blocks ``[limit, allocated)`` are withheld from
the scheduler and, once none is in use, their pages are returned to the OS.
The vLLM glue is in ``hooks.runtime``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vllm_kv_cache_limit.logic.errors import KVCacheResizeError
from vllm_kv_cache_limit.logic.sizes import format_size, parse_size, suggest_size

MODES = ("drain", "preempt")
"""``drain``: blocks above a lowered limit are withheld as the requests that
hold them finish. ``preempt``: those requests are preempted now and
recomputed (vLLM's own preemption), so the limit holds at once."""

NULL_BLOCKS = 1
"""Blocks vLLM's block pool holds back for good (block 0, the null block):
counted in ``num_gpu_blocks`` and allocated, but never given to a request."""


@dataclass(frozen=True)
class Allocation:
    """The KV cache one worker allocated at start-up, as the scheduler sees it."""

    num_blocks: int
    """Blocks allocated, the null block included (vLLM's ``num_gpu_blocks``)."""
    bytes_per_block: int
    """Bytes of one block over all layers of one worker."""
    blocks_per_request: int
    """Blocks one request of ``max_model_len`` tokens needs (all groups)."""
    max_model_len: int
    largest_bytes_per_block: int = 0
    """Bytes of one block on the worker that holds the most (pipeline stages
    can differ), rounded up; 0: ``bytes_per_block``."""
    blocks_per_chunk: int = 1
    """Blocks the workers return or commit together (vLLM 0.34's extensible
    KV cache maps whole chunks, ``logic.vmm_chunks``); 1 elsewhere."""

    def whole_chunks(self, blocks: int, up: bool) -> int:
        """``blocks`` rounded to whole chunks (up or down), within the
        allocation: a limit there holds exactly the memory it commits."""
        chunk = max(1, self.blocks_per_chunk)
        rounded = -(-blocks // chunk) * chunk if up else blocks // chunk * chunk
        return min(rounded, self.num_blocks)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def parse_mode(mode: object, quote: Callable[[object], str] = repr) -> str:
    """``mode`` checked against :data:`MODES`; the error quotes it (with
    ``quote``: ``repr`` for Python, ``json.dumps`` for an HTTP body)."""
    if isinstance(mode, bool) or mode not in MODES:
        raise KVCacheResizeError(f"Invalid resize mode {quote(mode)}: expected one of {', '.join(map(quote, MODES))}.")
    return str(mode)


def parse_timeout(timeout_s: object, quote: Callable[[object], str] = repr) -> float:
    """A finite timeout in seconds, zero or more; the error quotes it."""
    try:
        value = float(timeout_s)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = float("nan")
    if not (0 <= value < float("inf")):
        raise KVCacheResizeError(f"Invalid timeout_s {quote(timeout_s)}: expected a number of seconds, 0 or more.")
    return value


def parse_target(size: object, quote: Callable[[object], str] = repr) -> int:
    """A size in bytes from an int or a size string (``parse_size``)."""
    expected = f"expected a size such as {quote('16M')} or bytes as an int"
    if isinstance(size, bool):
        raise KVCacheResizeError(f"Invalid KV cache size {quote(size)}: {expected}.")
    if isinstance(size, int):
        if size <= 0:
            raise KVCacheResizeError(f"Invalid KV cache size {quote(size)}: it must be positive, e.g. {quote('16M')}.")
        return size
    if isinstance(size, str):
        try:
            return parse_size(size)
        except ValueError as exc:
            raise KVCacheResizeError(str(exc).replace(repr(size), quote(size), 1)) from None
    raise KVCacheResizeError(f"Invalid KV cache size {quote(size)}: {expected}.")


BODY_KEYS = ("size", "mode", "timeout_s")
"""The keys of the body of ``POST /kv_cache/max_memory``."""


def parse_body(body: object) -> tuple[int, str, float]:
    """The size, mode and timeout of a resize request's JSON body, checked
    whole before the engine is asked: an unknown key (``"mdoe"``) is refused
    rather than ignored, and errors quote the body as JSON."""
    quote = json.dumps
    example = '{"size": "16M", "mode": "drain"}'
    if not isinstance(body, dict):
        raise KVCacheResizeError(f"Invalid body {quote(body)}: expected a JSON object such as {example}.")
    unknown = [key for key in body if key not in BODY_KEYS]
    if unknown or "size" not in body:
        what = f"Unknown key {', '.join(map(quote, unknown))} in" if unknown else f"No {quote('size')} in"
        raise KVCacheResizeError(
            f"{what} the body {quote(body)}: the keys accepted are {', '.join(map(quote, BODY_KEYS))} "
            f"({quote('size')} required), for example {example}."
        )
    return (
        parse_target(body["size"], quote),
        parse_mode(body.get("mode", "drain"), quote),
        parse_timeout(body.get("timeout_s", 60.0), quote),
    )


def limit_for(nbytes: int, allocation: Allocation) -> int:
    """The block limit for ``nbytes`` per worker, refusing what the start-up
    allocation cannot give or what cannot hold one request of
    ``max_model_len``."""
    limit = nbytes // allocation.bytes_per_block
    least = allocation.blocks_per_request + NULL_BLOCKS
    least_bytes = least * allocation.bytes_per_block
    if nbytes > allocation.nbytes:
        raise KVCacheResizeError(
            f"Cannot raise the KV cache limit to {format_size(nbytes)} ({nbytes} bytes): the engine allocated "
            f"{format_size(allocation.nbytes)} ({allocation.nbytes} bytes) at start-up, the most a run-time "
            f"limit can reach. Choose a size of at most "
            f"{suggest_size(least_bytes, allocation.nbytes, prefer='most')}, or restart the "
            "engine with a larger --kv-cache-max-memory."
        )
    if limit < least:
        raise KVCacheResizeError(
            f"Cannot lower the KV cache limit to {format_size(nbytes)} ({nbytes} bytes): that is {limit} blocks "
            f"of {allocation.bytes_per_block} bytes, and one request of max_model_len {allocation.max_model_len} "
            f"needs {allocation.blocks_per_request} blocks (plus vLLM's null block). Choose a size of at least "
            f"{suggest_size(least_bytes, allocation.nbytes)} ({least_bytes} bytes)."
        )
    return limit


def page_ranges(spans: Iterable[tuple[int, int]], page_size: int) -> list[tuple[int, int]]:
    """Merge byte ranges ``[start, end)`` and shrink each to whole pages, so
    that only pages lying entirely inside them are released."""
    merged: list[list[int]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    pages = []
    for start, end in merged:
        first = -(-start // page_size) * page_size
        last = end // page_size * page_size
        if last > first:
            pages.append((first, last))
    return pages


def block_spans(address: int, stride: int, block_bytes: int, first: int, count: int) -> list[tuple[int, int]]:
    """The byte ranges of blocks ``[first, count)`` of one blocks-first KV
    cache view: block ``i`` lies at ``address + i * stride``."""
    if block_bytes >= stride:  # blocks back to back: one range
        return [(address + first * stride, address + (count - 1) * stride + block_bytes)] if count > first else []
    return [(address + i * stride, address + i * stride + block_bytes) for i in range(first, count)]


def status(
    allocation: Allocation,
    limit: int,
    requested: int,
    mode: str,
    in_use: int,
    in_use_above: int,
    released_bytes: int,
) -> dict[str, Any]:
    """The status dict of ``kv_cache_limit_status`` (plain types only: it
    crosses vLLM's engine-core channel)."""
    return {
        "kv_cache_max_memory": requested,
        "kv_cache_limit_bytes": limit * allocation.bytes_per_block,
        "kv_cache_allocated_bytes": allocation.nbytes,
        "num_blocks_limit": limit,
        "num_blocks_allocated": allocation.num_blocks,
        "num_blocks_in_use": in_use,
        "num_blocks_in_use_above_limit": in_use_above,
        "bytes_per_block": allocation.bytes_per_block,
        "holds": in_use_above == 0,
        "mode": mode,
        "released_bytes": released_bytes,
    }


def merged(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    """One status for a data-parallel engine from its engine cores' (in rank
    order): the first one's fields, ``holds`` only when every limit holds,
    ``released_bytes`` summed, and each engine's status under ``engines``."""
    result = dict(statuses[0])
    result["holds"] = all(s["holds"] for s in statuses)
    result["released_bytes"] = sum(s["released_bytes"] for s in statuses)
    result["num_blocks_in_use_above_limit"] = max(s["num_blocks_in_use_above_limit"] for s in statuses)
    result["engines"] = [dict(s) for s in statuses]
    return result


def restore_targets(before: list[dict[str, Any]], replies: list[Any]) -> list[tuple[int, int, str]]:
    """After a change that some engine cores of a data-parallel engine refused
    or failed: ``(index, size, mode)`` of each engine core that took it, to
    set back to the limit it had (``before``), so that every engine core keeps
    one limit. Empty when every engine core took the change, or none did."""
    if not any(is_error(reply) for reply in replies):
        return []
    return [
        (index, old["kv_cache_max_memory"], old["mode"])
        for index, (old, reply) in enumerate(zip(before, replies, strict=True))
        if not is_error(reply)
    ]


def is_error(reply: Any) -> bool:
    """Whether an engine core's reply to a resize call is a refusal or a
    failure (``{"error": ...}``) rather than a status."""
    return isinstance(reply, dict) and "error" in reply
