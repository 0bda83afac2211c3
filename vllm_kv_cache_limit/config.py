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

    Start-up fails with a clear error when the cap is above the device's total
    memory, when the cap plus the model's weights cannot fit in the free memory
    (both before weights load), when the cap is above what the device can still
    give this instance after profiling, or when it is too small for one request
    of max_model_len.

    Units: K M G T are binary and k m g t decimal, as in vLLM's other size
    arguments; KiB MiB GiB TiB (binary) and KB MB GB TB (decimal) in any case;
    a plain number is bytes; decimals are allowed. Examples: `8G` (8 GiB),
    `512MiB`, `1.5GiB`, `16GB` (16 * 10^9 bytes). The environment variable
    `VLLM_KV_CACHE_MAX_MEMORY` supplies the value when the argument is not
    given."""


FIELD = "kv_cache_max_memory"
"""The field's name: on ``EngineArgs``, on vLLM's ``CacheConfig`` (pickled to
every process) and in ``CacheConfig.metrics_info``."""


def cap_of(cache_config: Any) -> int | None:
    """The cap carried on vLLM's CacheConfig, in bytes (None: no cap)."""
    return getattr(cache_config, FIELD, None)
