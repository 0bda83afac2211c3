"""The cap decision: how ``kv_cache_max_memory`` combines with vLLM's own KV
cache budget, ``kv_cache_memory_bytes`` and ``num_gpu_blocks_override``, and
the checks against the device's memory.

Pure logic: no vLLM import. The vLLM glue in ``_hooks`` calls these functions
with numbers it read from vLLM and turns their messages into log lines and
errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kv_cache_limit.sizes import format_gib, format_size, parse_size

__all__ = [
    "ENV_VAR",
    "FLAG",
    "FREE_MEMORY_TOLERANCE",
    "CapDecision",
    "KVCacheMaxMemoryError",
    "cap_budget",
    "cap_explicit_size",
    "cap_block_override",
    "check_cap_within_free",
    "check_cap_within_total",
    "resolve_cap",
    "too_small_message",
]

FLAG = "--kv-cache-max-memory"
ENV_VAR = "VLLM_KV_CACHE_MAX_MEMORY"
FREE_MEMORY_TOLERANCE = 0.01
"""A cap may exceed the free memory read in the worker by this fraction."""


class KVCacheMaxMemoryError(ValueError):
    """``kv_cache_max_memory`` cannot be honoured on this device."""


def _gib(nbytes: int) -> str:
    # GiB with two decimals as vLLM writes memory, unless that would read 0.00.
    if nbytes < 10 * 2**20:
        return format_size(nbytes, "up")
    return f"{format_gib(nbytes)} GiB"


def resolve_cap(argument: str | int | None, environ_value: str | None) -> int | None:
    """The cap in bytes: the explicit argument, else the environment variable,
    else None (no cap). An empty environment variable counts as unset."""
    if argument is not None:
        return parse_size(argument)
    if environ_value is None or environ_value.strip() == "":
        return None
    try:
        return parse_size(environ_value)
    except ValueError as exc:
        raise ValueError(f"{ENV_VAR}: {exc}") from None


@dataclass(frozen=True)
class CapDecision:
    """What the KV cache of one worker gets under the cap."""

    budget: int
    """vLLM's own KV cache budget for the worker, in bytes."""
    cap: int
    """The cap, in bytes."""

    @property
    def kv_bytes(self) -> int:
        """Memory handed to vLLM's block computation: the smaller of the two."""
        return min(self.budget, self.cap)

    @property
    def bound(self) -> bool:
        """Whether the cap, not vLLM's budget, decides the KV cache size."""
        return self.cap < self.budget


def cap_budget(budget: int, cap: int | None) -> CapDecision | None:
    """Combine vLLM's budget for one worker with the cap (None: no cap)."""
    if cap is None:
        return None
    return CapDecision(budget=budget, cap=cap)


def cap_explicit_size(
    kv_cache_memory_bytes: int | None, cap: int | None
) -> tuple[int | None, str | None]:
    """Reduce an explicit ``kv_cache_memory_bytes`` to the cap when larger.

    Returns the size to use and, when it was reduced, a warning to log.
    """
    if cap is None or kv_cache_memory_bytes is None or kv_cache_memory_bytes <= cap:
        return kv_cache_memory_bytes, None
    warning = (
        f"kv_cache_memory_bytes={kv_cache_memory_bytes} "
        f"({_gib(kv_cache_memory_bytes)}) is larger than "
        f"kv_cache_max_memory={cap} ({_gib(cap)}); reducing "
        f"kv_cache_memory_bytes to {cap} bytes. Pass {FLAG} {format_size(kv_cache_memory_bytes, 'up')} "
        f"or a smaller --kv-cache-memory-bytes to silence this warning."
    )
    return cap, warning


def cap_block_override(
    override: int | None, blocks_within_cap: int, cap: int
) -> tuple[int | None, str | None]:
    """Reduce ``num_gpu_blocks_override`` to the whole blocks that fit the cap.

    ``blocks_within_cap`` is the block count vLLM computes for ``cap`` bytes.
    Returns the override to use and, when it was reduced, a warning to log.
    """
    if override is None or override <= blocks_within_cap:
        return override, None
    warning = (
        f"num_gpu_blocks_override={override} needs more than "
        f"kv_cache_max_memory={cap} ({_gib(cap)}) allows; reducing it to "
        f"{blocks_within_cap} blocks, the most that fit in the cap."
    )
    return blocks_within_cap, warning


def check_cap_within_total(cap: int, total: int, device: str) -> None:
    """Fail fast, before any weights load: a cap above the device's total
    memory can never be honoured."""
    if cap > total:
        raise KVCacheMaxMemoryError(
            f"{FLAG} {format_size(cap, 'up')} ({cap} bytes, {_gib(cap)}) is larger "
            f"than the total memory of the {device} ({total} bytes, {_gib(total)}). "
            f"The cap is per device; choose at most {format_size(total, 'down')}, "
            f"for example {FLAG} {format_size(total // 2, 'down')}."
        )


def check_cap_within_free(
    cap: int,
    free: int,
    total: int,
    device: str,
    tolerance: float = FREE_MEMORY_TOLERANCE,
) -> None:
    """In the worker, after the weights load and before the KV cache is
    allocated: a cap above the device's free memory (plus ``tolerance``)
    would only fail later, so stop now."""
    if cap > free * (1 + tolerance):
        raise KVCacheMaxMemoryError(
            f"{FLAG} {format_size(cap, 'up')} ({cap} bytes, {_gib(cap)}) is larger "
            f"than the free memory of the {device} after loading the model: "
            f"{_gib(free)} free of {_gib(total)} total. Free memory on the "
            f"device, or choose a cap that fits, for example "
            f"{FLAG} {format_size(free, 'down')}."
        )


def too_small_message(
    cap: int, needed: int, reserved: int, max_model_len: int, estimated_max_model_len: int
) -> str:
    """The error for a cap that cannot hold one request of ``max_model_len``.

    ``needed`` is vLLM's estimate of the KV cache one such request needs,
    ``reserved`` the memory vLLM holds back from the cap (its null block), and
    ``estimated_max_model_len`` vLLM's estimate of what fits in the cap.
    """
    smallest = needed + reserved
    fit = (
        f"The largest max_model_len that fits in the cap is "
        f"{estimated_max_model_len}: pass --max-model-len "
        f"{estimated_max_model_len} or less, or raise the cap to at least "
        f"{FLAG} {format_size(smallest, 'up')}."
        if estimated_max_model_len > 0
        else f"Raise the cap to at least {FLAG} {format_size(smallest, 'up')}."
    )
    return (
        f"{FLAG} {format_size(cap, 'up')} ({cap} bytes, {_gib(cap)}) is too "
        f"small for one request of max_model_len={max_model_len}, which needs "
        f"{needed} bytes ({_gib(needed)}) of KV cache, plus {reserved} bytes "
        f"that vLLM reserves (one block). {fit}"
    )
