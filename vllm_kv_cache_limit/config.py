"""The plugin's configuration field, written the way vLLM writes its own.

vLLM turns the docstring under each config field into the field's CLI help
(``vllm.config.utils.get_attr_docs``); the help of ``--kv-cache-max-memory``
comes from the docstring below in the same way. No vLLM import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class KVCacheLimitConfig:
    """KV cache memory limit, added to vLLM's CacheConfig by the
    vllm-kv-cache-limit plugin."""

    kv_cache_max_memory: int | None = None
    """Upper bound on the memory of the KV cache, per device (per GPU, or per
    worker on the CPU backend). The KV cache gets the smaller of vLLM's own
    budget and this cap; None (the default) means no cap. The number of KV
    cache blocks is the number of whole blocks that fit in the cap.

    - With `--gpu-memory-utilization` (vLLM's budget): the cap only lowers the
      KV cache, never raises it; memory it frees stays free on the device.
    - With `--kv-cache-memory-bytes` (or `VLLM_CPU_KVCACHE_SPACE` on the CPU
      backend): an explicit size above the cap is reduced to the cap, with a
      warning; a smaller one is kept.
    - With `--num-gpu-blocks-override`: reduced, with a warning, to the number
      of whole blocks that fit in the cap.

    With a cap, `--gpu-memory-utilization` is a ceiling, not a demand: the
    instance asks for the smaller of it and the memory free at start-up, so it
    starts beside other processes in any order; capped instances take a
    start-up lock per device so that their memory measurements never overlap.

    Start-up fails with a clear error when the cap is below one KV cache
    block of any model (`8 G` unquoted: write `8G`), above the device's total
    memory, when the cap plus the model's weights cannot fit in the free memory
    (both before weights load), when the cap is above what the device can still
    give this instance after profiling, or when it is too small for one request
    of max_model_len.

    Units: K M G T are binary and k m g t decimal, as in vLLM's other size
    arguments; KiB MiB GiB TiB (binary) and KB MB GB TB (decimal), the prefix
    in any case (a lower-case b, bits, is refused);
    a plain number is bytes; decimals are allowed. Examples: `8G` (8 GiB),
    `512MiB`, `1.5GiB`, `16GB` (16 * 10^9 bytes). The environment variable
    `VLLM_KV_CACHE_MAX_MEMORY` supplies the value when the argument is not
    given."""

    kv_cache_autoscale: bool = False
    """Let the KV cache limit follow the workload, within the memory
    allocated at start-up (`--kv-cache-max-memory`, which it needs). The
    engine starts at its floor (`--kv-cache-min-memory`) and returns the
    pages above it to the OS; it grows at once when requests wait for
    blocks, to their demand plus headroom, and shrinks in drain mode (never
    preempting) when the demand has stayed below the limit for
    `VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S` seconds (default 30). Each change
    is logged and shown by `GET /kv_cache/max_memory` and the
    `vllm:kv_cache_limit_bytes` metric; a manual resize sets the ceiling it
    stays under. On CUDA the limit is logical: memory is not returned."""

    kv_cache_min_memory: int | None = None
    """The least KV cache an autoscaled engine keeps, per device (same units
    as `--kv-cache-max-memory`); at most the cap. Default: one request of
    max_model_len. Needs `--kv-cache-autoscale`."""

    kv_cache_shared_budget: int | None = None
    """One KV cache budget per device for every autoscaled instance on this
    host that gives the same value (same units as `--kv-cache-max-memory`):
    their limits never add up to more than it. Each takes its share through
    a ledger in the start-up lock folder (`VLLM_KV_CACHE_LIMIT_LOCK_DIR`,
    shared by containers through a volume); when the budget is used and
    another instance needs blocks, an instance holding more than its
    entitlement gives back what the other needs: under contention the
    budget is split max-min fair, each instance with demand guaranteed its
    target up to an even share and its floor, the rest lent and reclaimed
    within about a second. An instance that exits or dies gives its share back.
    Needs `--kv-cache-autoscale`."""


FIELD = "kv_cache_max_memory"
"""The field's name: on ``EngineArgs``, on vLLM's ``CacheConfig`` (pickled to
every process) and in ``CacheConfig.metrics_info``."""


AUTOSCALE_FIELDS = ("kv_cache_autoscale", "kv_cache_min_memory", "kv_cache_shared_budget")
"""The autoscaling fields: on ``EngineArgs`` and, with a cap, on vLLM's ``CacheConfig``."""


def cap_of(cache_config: Any) -> int | None:
    """The cap carried on vLLM's CacheConfig, in bytes (None: no cap)."""
    return getattr(cache_config, FIELD, None)
