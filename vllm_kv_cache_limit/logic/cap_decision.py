"""The cap decision: how ``kv_cache_max_memory`` combines with vLLM's own KV
cache budget, ``kv_cache_memory_bytes`` and ``num_gpu_blocks_override``, and
the checks against the device's memory.

Pure logic: no vLLM import. The vLLM glue in ``hooks.cap`` calls these functions
with numbers it read from vLLM and turns their messages into log lines and
errors.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from vllm_kv_cache_limit.logic import envs
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError
from vllm_kv_cache_limit.logic.sizes import format_gib, format_size, parse_size

__all__ = [
    "CAP_TOLERANCE",
    "cap_error_message",
    "ENV_VAR",
    "FLAG",
    "CapDecision",
    "cap_explicit_size",
    "cap_block_override",
    "check_cap_fits_before_load",
    "kv_bytes_before_load",
    "check_explicit_size_within_free",
    "check_cap_within_instance",
    "check_cap_within_total",
    "auto_fit_message",
    "mamba_blocks_message",
    "utilization_ceiling",
    "resolve_cap",
    "tolerance_bytes",
    "too_small_message",
]

FLAG = "--kv-cache-max-memory"
ENV_VAR = envs.MAX_MEMORY


CAP_TOLERANCE = Fraction(1, 100)
"""How far above the memory the device can give the KV cache a cap is still
accepted, as a fraction of that memory: vLLM's budget after profiling where
free memory set it, or before the weights load the free memory less the
weights. Absorbs rounding (a cap written in whole GiB) and drift between
readings; the KV cache then gets that memory, never more. Explicit sizes
(``--kv-cache-memory-bytes``) get none: vLLM allocates them whole, without
measuring. A ``Fraction`` so that the edges are exact."""


def tolerance_bytes(available: int) -> int:
    """The bytes by which a cap may exceed ``available``: :data:`CAP_TOLERANCE`
    of it in whole bytes (none when nothing is available)."""
    return math.floor(max(available, 0) * CAP_TOLERANCE)


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
        raise KVCacheMaxMemoryError(f"{ENV_VAR}: {exc}") from None


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


def cap_explicit_size(kv_cache_memory_bytes: int | None, cap: int | None) -> tuple[int | None, str | None]:
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


def cap_block_override(override: int | None, blocks_within_cap: int, cap: int) -> tuple[int | None, str | None]:
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


def _cap_words(cap: int) -> str:
    """How the messages name the cap: the flag, its size, its bytes."""
    return f"{FLAG} {format_size(cap, 'up')} ({cap} bytes, {_gib(cap)})"


def _larger_than(subject: str, memory: str, advice: str) -> KVCacheMaxMemoryError:
    """The error for a size above what the device has: ``memory`` names that
    memory with its reading, ``advice`` says what would work."""
    return KVCacheMaxMemoryError(f"{subject} is larger than the {memory}. {advice}")


def check_cap_within_total(cap: int, total: int, device: str) -> None:
    """Fail fast, before any weights load: a cap above the device's total
    memory can never be honoured."""
    if cap > total:
        raise _larger_than(
            _cap_words(cap),
            f"total memory of the {device} ({total} bytes, {_gib(total)})",
            f"The cap is per device; choose at most {format_size(total, 'down')}, "
            f"for example {FLAG} {format_size(total // 2, 'down')}.",
        )


SMALLEST_DEFAULT_BLOCK_SIZE = 16
"""The smallest block size in tokens vLLM picks itself on any platform."""

SMALLEST_TOKEN_BYTES = 2 * 8 * 1
"""KV cache bytes of one token of the smallest model: K and V, one layer,
one KV head of 8 dimensions (the least vLLM's attention backends take), fp8."""


def smallest_block_bytes(block_size: int | None) -> int:
    """A lower bound on one KV cache block of any model, known before the
    model's config is read: ``block_size`` tokens (vLLM's smallest default
    where it is not given) of the smallest token."""
    return (block_size or SMALLEST_DEFAULT_BLOCK_SIZE) * SMALLEST_TOKEN_BYTES


def check_cap_holds_a_block(cap: int, block_size: int | None) -> None:
    """Fail fast, before any weights load: a cap below one block of the
    smallest model can hold no KV cache at all. Such a cap is mostly a size
    the shell split (``--kv-cache-max-memory 8 G`` unquoted gives 8 bytes,
    and ``G`` becomes another argument), so the error says how to write it."""
    least = smallest_block_bytes(block_size)
    if cap < least:
        raise KVCacheMaxMemoryError(
            f"{FLAG} {format_size(cap)} ({cap} bytes) is smaller than one KV cache block of any model "
            f"(at least {least} bytes at a block size of {block_size or SMALLEST_DEFAULT_BLOCK_SIZE}). "
            f"A size with a space must be quoted ({FLAG} '{cap} G'), or written without one ({FLAG} {cap}G); "
            "unquoted, the shell passes the unit as another argument. A plain number is bytes."
        )


def check_explicit_size_within_free(size: int, cap: int, free: int, total: int, device: str) -> None:
    """With an explicit KV cache size (``kv_cache_memory_bytes``, already
    reduced to the cap), vLLM allocates exactly ``size`` without measuring:
    in the worker, after the weights load and before the KV cache is
    allocated, refuse a size above the free memory. No tolerance: vLLM would
    allocate all of it."""
    if size <= free:
        return
    source = (
        f"{FLAG} {format_size(cap, 'up')}"
        if size == cap
        else f"--kv-cache-memory-bytes {size} (under {FLAG} {format_size(cap, 'up')})"
    )
    raise _larger_than(
        f"The KV cache of {size} bytes ({_gib(size)}) set by {source}",
        f"free memory of the {device} after loading the model: {_gib(free)} free of {_gib(total)} total",
        f"Free memory on the device, or choose a size that fits, for example {FLAG} {format_size(free, 'down')}.",
    )


def too_small_message(cap: int, needed: int, reserved: int, max_model_len: int, estimated_max_model_len: int) -> str:
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
        f"{_cap_words(cap)} is too "
        f"small for one request of max_model_len={max_model_len}, which needs "
        f"{needed} bytes ({_gib(needed)}) of KV cache, plus {reserved} bytes "
        f"that vLLM reserves (one block). {fit}"
    )


def utilization_ceiling(total: int, free: int, utilization: float, external: int = 0, slack: int = 0) -> float | None:
    """With a cap, ``--gpu-memory-utilization`` is a ceiling, not a demand.

    vLLM asks for ``ceil(total * utilization)`` (less ``external``, weights
    held by another process) and refuses to start when that much is not free.
    Returns the utilization that asks for what is free less ``slack`` (so
    that vLLM's own gate passes), or None when vLLM's request is free already.
    """
    requested = math.ceil(total * utilization) - external
    if requested <= free:
        return None
    target = max(0, free - slack) + external
    ceiling = min(utilization, target / total)
    while ceiling > 0 and math.ceil(total * ceiling) - external > free - slack:
        ceiling = math.nextafter(ceiling, 0.0)
    return max(ceiling, 0.0)


def check_cap_within_instance(cap: int, budget: int, free_at_start: int, non_kv: int, device: str) -> int:
    """After the weights load and activations are profiled, on a device whose
    free memory (not ``--gpu-memory-utilization``) limited vLLM's budget: a
    cap more than :data:`CAP_TOLERANCE` above the budget cannot be given to
    this instance, because other processes hold the rest of the device.
    Returns how far a tolerated cap is above the budget (0: not above); the
    KV cache then gets the budget (``CapDecision.kv_bytes``)."""
    if cap <= budget + tolerance_bytes(budget):
        return max(cap - budget, 0)
    fit = (
        f"Choose a cap that fits, for example {FLAG} {format_size(budget, 'down')}, "
        if budget > 0
        else "Nothing is left for the KV cache; "
    )
    raise KVCacheMaxMemoryError(
        f"{_cap_words(cap)} is larger than "
        f"what the {device} can still give this instance: {_gib(free_at_start)} "
        f"({free_at_start} bytes) was free at start-up (other processes hold the "
        f"rest), and this instance needs {_gib(non_kv)} ({non_kv} bytes) besides "
        f"its KV cache (weights, activations, runtime), which leaves "
        f"{_gib(max(budget, 0))} ({max(budget, 0)} bytes) for the KV cache. "
        f"{fit}or free memory held by other processes."
    )


def kv_bytes_before_load(cap: int, kv_cache_memory_bytes: int | None, num_gpu_blocks_override: int | None) -> int:
    """The KV cache bytes per worker that the check before loading counts:
    what will be allocated, as far as it is known before the model loads.
    An explicit size (``--kv-cache-memory-bytes``, or the CPU backend's
    ``VLLM_CPU_KVCACHE_SPACE``, which vLLM turns into it) is allocated exactly,
    reduced to the cap; with ``num_gpu_blocks_override`` the size of a block
    is known only once the workers report their layers, so nothing is counted
    (the engine core reduces the override to the cap, the workers check the
    rest); else the cap."""
    if kv_cache_memory_bytes is not None:
        return min(kv_cache_memory_bytes, cap)
    if num_gpu_blocks_override is not None:
        return 0
    return cap


def check_cap_fits_before_load(
    cap: int,
    weight_bytes: int,
    workers: int,
    free: int,
    device: str,
    kv_bytes: int | None = None,
    explicit: bool = False,
) -> None:
    """In the first process, before any weights load: refuse a cap that cannot
    possibly fit, that is when ``workers`` KV caches of ``kv_bytes`` (default:
    the cap; see :func:`kv_bytes_before_load`) plus the ``weight_bytes`` these
    workers load (a lower bound) exceed the ``free`` memory of their devices
    by more than :data:`CAP_TOLERANCE` of what the weights leave. An
    ``explicit`` size (``--kv-cache-memory-bytes``, even one the cap reduced
    to itself) gets no tolerance: vLLM allocates all of it. Anything else may
    fit and is left to the workers' checks."""
    kv = cap if kv_bytes is None else kv_bytes
    need = weight_bytes + workers * kv
    tolerance = 0 if explicit or kv != cap else tolerance_bytes(free - weight_bytes)
    if need <= free + tolerance:
        return
    per_worker = (free - weight_bytes) // workers if workers else 0
    weights = (
        f"the model's weights take at least {_gib(weight_bytes)} ({weight_bytes} bytes) there and "
        if weight_bytes
        else ""
    )
    if kv == cap:
        subject, caps, flag = _cap_words(cap), (f"{workers} x the cap" if workers > 1 else "the cap"), FLAG
    else:
        subject = f"The KV cache of {kv} bytes ({_gib(kv)}) set by --kv-cache-memory-bytes (under {_cap_words(cap)})"
        caps = f"{workers} x that size" if workers > 1 else "that size"
        flag = "--kv-cache-memory-bytes"
    fit = (
        f"Choose at most {flag} {format_size(per_worker, 'down')}, or free memory held by other processes."
        if per_worker > 0
        else "The weights alone do not fit in the free memory; free memory held by other processes."
    )
    raise KVCacheMaxMemoryError(
        f"{subject} cannot fit on "
        f"the {device}: {weights}{_gib(free)} ({free} bytes) is free, less than "
        f"{caps} plus the weights ({_gib(need)}, {need} bytes). {fit}"
    )


def auto_fit_message(cap: int) -> str:
    """The error for ``--max-model-len auto`` when the cap leaves no room for
    a single token."""
    return (
        f"{_cap_words(cap)} is too small "
        f"for even one token with --max-model-len auto: vLLM fits the context "
        f"length to the KV cache, and the cap leaves no whole block besides the "
        f"one vLLM reserves. Raise the cap (vllm-kv-plan MODEL --max-model-len L "
        f"tells how much L tokens need), or pass an explicit --max-model-len."
    )


def mamba_blocks_message(cap: int, num_blocks: int, max_num_seqs: int, block_bytes: int) -> str:
    """The error for a hybrid (Mamba) model with full CUDA graphs whose
    capped KV cache has fewer blocks than ``max_num_seqs``: each decoding
    sequence needs one block."""
    need = max_num_seqs * block_bytes
    return (
        f"{_cap_words(cap)} gives "
        f"{num_blocks} KV cache blocks, fewer than max_num_seqs={max_num_seqs}: "
        f"with full CUDA graphs each decoding sequence of this hybrid (Mamba) "
        f"model needs one block. Pass --max-num-seqs {num_blocks} or less, raise "
        f"the cap to at least {FLAG} {format_size(need, 'up')}, or capture "
        f"piecewise CUDA graphs only (--compilation-config "
        f'\'{{"cudagraph_mode": "PIECEWISE"}}\') or none (--enforce-eager).'
    )


_WORKER_FAILED = re.compile(r"Worker failed with error '(.*)', please check the stack trace above", re.S)


def cap_error_message(exc: BaseException) -> str | None:
    """The cap error inside an executor's exception, if there is one: a
    ``KVCacheMaxMemoryError`` in the chain (Ray's ``RayTaskError`` is one
    and holds it as ``cause``), or the worker's message in the text of
    vLLM's Ray executor ("Worker failed with error '...'") when it names the
    flag, as every cap error does."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, KVCacheMaxMemoryError):
            cause = getattr(current, "cause", None)
            return str(cause if isinstance(cause, KVCacheMaxMemoryError) else current)
        match = _WORKER_FAILED.search(str(current))
        if match and FLAG in match[1]:
            return match[1]
        current = current.__cause__ or current.__context__
    return None
