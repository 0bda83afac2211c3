"""Every attribute of a vLLM object (or a private one of Python's standard
library) the plugin relies on: ``ATTRIBUTES`` for the cap, checked at
start-up under a cap, and ``RESIZE_ATTRIBUTES`` for run-time resize. No
vLLM import.
"""

from __future__ import annotations

from vllm_kv_cache_limit.compat.entries import Attribute

_STDLIB = "Python's standard library, not part of a vLLM build: checked on the running interpreter only"
_KV_CACHE_INTERFACE = ("vllm.v1.kv_cache_interface",)
_CPU_RESOURCES = ("vllm.utils.cpu_resource_utils",)

ATTRIBUTES: tuple[Attribute, ...] = (
    *(
        Attribute((module,), owner, attr, why)
        for module, owner, attr, why in (
            (
                "vllm.v1.worker.worker_base",
                "WorkerBase",
                "vllm_config",
                "`worker_gate.record_worker_cap`: the worker's config, which holds the worker's state",
            ),
            (
                "vllm.v1.worker.worker_base",
                "WorkerBase",
                "parallel_config",
                "`devices.cpu_free_memory`: the worker's ranks, for its memory node",
            ),
            (
                "vllm.config.vllm",
                "VllmConfig",
                "compilation_config",
                "`WorkerState.of_config`: holds the worker's state, for the cap decision where vLLM resolves "
                "the CUDA graph sizes",
            ),
            (
                "vllm.config.vllm",
                "VllmConfig",
                "cache_config",
                "`WorkerState.of_config`: holds the worker's state, for the gate where the GPU worker's start-up "
                "gate runs",
            ),
            (
                "vllm.config.cache",
                "CacheConfig",
                "num_gpu_blocks",
                "`_report_final_size`: the blocks vLLM settled on, kept at the cap's reservation (set by vLLM, not a flag)",
            ),
            (
                "vllm.config.parallel",
                "ParallelConfig",
                "local_world_size",
                "`devices._local_gpu_ids`: the workers on this node",
            ),
            (
                "vllm.config.parallel",
                "ParallelConfig",
                "nnodes_within_dp",
                "`devices._dp_device_rank`: the nodes of a data-parallel rank",
            ),
            (
                "vllm.config.parallel",
                "ParallelConfig",
                "data_parallel_index",
                "`devices._dp_device_rank`: this data-parallel rank",
            ),
            (
                "vllm.config.parallel",
                "ParallelConfig",
                "assigned_physical_gpu_ids",
                "`devices._local_gpu_ids`, `devices.cpu_memory_node`: the devices a rank was given",
            ),
            (
                "vllm.platforms.interface",
                "Platform",
                "device_type",
                "`devices.device_total_memory`, `devices.instance_devices`: a device's name",
            ),
            (
                "vllm.platforms.interface",
                "Platform",
                "device_control_env_var",
                "`devices._local_gpu_ids`: the variable naming the visible devices",
            ),
        )
    ),
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
        ("vllm.envs",),
        "",
        "environment_variables",
        "`register_environment_variables`: the table `Platform.validate_environ` checks `VLLM_*` variables "
        "against; the plugin's that are set are added to it",
    ),
    Attribute(
        ("vllm.config.model",),
        "ModelConfig",
        "quantization",
        "`check_fits_before_load`: weights are counted from the safetensors headers only when unquantized",
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
        ("vllm.config.cache",),
        "CacheConfig",
        "gpu_memory_utilization",
        "`compat.set_gpu_memory_utilization`: lowered to the free memory under a cap (a copy at the GPU gate, "
        "the worker's own for the CPU gate's call); read by `compat.gpu_memory_utilization` before vLLM 0.34",
    ),
    Attribute(
        ("vllm.config.cache",),
        "CacheConfig",
        "resolved_gpu_memory_utilization",
        "`compat.gpu_memory_utilization`: the utilization vLLM sizes with, its field being None by default "
        "(1.0 with the extensible KV cache); the gates and the start-up line read it",
        versions=">=0.34",
    ),
    Attribute(
        _CPU_RESOURCES,
        "MemoryNodeInfo",
        "total_memory",
        "`device_total_memory`, `cpu_node_memory`: a memory node's size on the CPU backend",
    ),
    Attribute(
        _CPU_RESOURCES,
        "MemoryNodeInfo",
        "available_memory",
        "`cpu_node_memory`: a memory node's free memory on the CPU backend",
    ),
    Attribute(
        _CPU_RESOURCES,
        "LogicalCPUInfo",
        "numa_node",
        "`instance_devices`, `cpu_memory_node`, `_lower_cpu_request`: the memory nodes this instance's workers use",
    ),
    Attribute(
        ("vllm.v1.worker.worker_base",),
        "WorkerBase",
        "cache_config",
        "`check_cap_fits_instance`, `_lower_cpu_request`: the cap, in every GPU and CPU worker",
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
    Attribute(
        ("vllm.v1.engine.core",),
        "",
        "EngineCoreProc",
        "`engine_core._in_own_process`, `shared_budget.leave_after_failure`, `wakeups.start_waking`: "
        "the engine core in a process of its own",
    ),
)
"""Attributes of vLLM objects (and private ones of Python's standard
library) that enforcing the cap reads or writes: checked at start-up with a
cap beside ``HOOKS`` and by ``scripts/check_hooks.py``. vLLM's public
configuration fields that are CLI flags (``CacheConfig.block_size``,
``ParallelConfig.world_size``, ...) are not listed: they are read without a
default, so a rename fails loudly, and vLLM deprecates a flag before it
renames it."""


_RESIZE_WITHHOLD = "`RuntimeLimit.withhold`: which free blocks at or above the limit leave the free queue"
_RESIZE_CLIENT = "`set_kv_cache_max_memory`, `kv_cache_limit_status` (and their async forms): the engine-core client"

RESIZE_ATTRIBUTES: tuple[Attribute, ...] = (
    *(
        Attribute(
            (module,),
            owner,
            attr,
            f"`hooks.runtime.extensible_kv_cache.clear_stale_block_ids`: {why}",
            versions=">=0.34",
        )
        for module, owner, attr, why in (
            (
                "vllm.v1.worker.gpu.model_runner",
                "GPUModelRunner",
                "block_tables",
                "the runner's block tables, whose stale entries above the limit are cleared",
            ),
            (
                "vllm.v1.worker.gpu.model_runner",
                "GPUModelRunner",
                "pcp_manager",
                "prefill context parallelism's local block tables",
            ),
            (
                "vllm.v1.worker.gpu.model_runner",
                "GPUModelRunner",
                "extensible_kv_cache",
                "the worker's extensible KV cache (none: the worker returns no GPU memory)",
            ),
            (
                "vllm.v1.worker.gpu.model_runner",
                "GPUModelRunner",
                "cache_config",
                "the cap the chunk plan is given under",
            ),
            ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "vllm_config", "the features that refuse a plan"),
            ("vllm.v1.worker.gpu.block_table", "BlockTables", "block_tables", "each group's per-request table"),
            (
                "vllm.v1.worker.gpu.block_table",
                "BlockTables",
                "input_block_tables",
                "each group's table of the forward pass",
            ),
            ("vllm.v1.worker.gpu.buffer_utils", "StagedWriteTensor", "gpu", "the device copy of a table"),
            (
                "vllm.v1.worker.gpu.pcp_manager",
                "PCPManager",
                "_local_block_tables",
                "the local tables under prefill context parallelism",
            ),
        )
    ),
    *(
        Attribute(
            ("vllm.utils.extensible_tensor",),
            "_VirtualBuffer",
            attr,
            f"`hooks.runtime.extensible_tensor.unmap`: {why}",
            versions=">=0.34",
        )
        for attr, why in (
            ("_handles", "the mapped chunks, those above the limit unmapped and forgotten"),
            ("_mapped_granules", "the granules vLLM skips when it commits; released ones are dropped"),
            ("_driver", "the VMM driver the chunks are unmapped and released through"),
            ("base_ptr", "the reservation's address, where a chunk's offset starts"),
            ("granularity", "the granule, to drop a released chunk's granules"),
        )
    ),
    *(
        Attribute(
            ("vllm.utils.extensible_tensor",),
            "ExtensibleTensor",
            attr,
            f"`hooks.runtime.extensible_kv_cache.release_above`: {why}",
            versions=">=0.34",
        )
        for attr, why in (
            ("_buffer", "the virtual buffer a chunk plan is given to and released from"),
            ("granularity", "the driver's granularity, which the chunk plan rounds to whole blocks"),
            ("device", "the device waited for before chunks are unmapped"),
            ("_committed", "each segment's committed prefix, lowered to the limit after a release"),
        )
    ),
    *(
        Attribute(
            ("vllm.v1.worker.extensible_kv_cache",),
            "ExtensibleKVCache",
            attr,
            f"`hooks.runtime.extensible_kv_cache.release_above`: {why}",
            versions=">=0.34",
        )
        for attr, why in (
            ("num_committed_blocks", "lowered to the limit after a release, so that wake-up recommits the limit"),
            ("buffer", "the ExtensibleTensor behind the cache"),
            ("segment_offsets", "where each segment starts: the chunk plan"),
            ("segment_strides", "each segment's bytes per block: the chunk plan"),
            ("capacity_blocks", "the reservation in blocks: the chunk plan"),
            ("min_committed_blocks", "the blocks that stay mapped whatever the limit"),
            ("physical_bytes", "what is mapped: zero while the engine sleeps"),
        )
    ),
    *(
        Attribute(
            ("vllm.v1.worker.extensible_kv_cache",),
            "ExtensibleKVCache",
            attr,
            f"`hooks.runtime.extensible_kv_cache.committable`: {why}",
            versions=">=0.34",
        )
        for attr, why in (("torch_memory_limit", "what torch may reserve, left free by a raised limit"),)
    ),
    Attribute(
        ("vllm.config.cache",),
        "CacheConfig",
        "enable_extensible_kv_cache",
        "`hooks.runtime.extensible_kv_cache.refusal`, `_read_allocation`: whether the workers map the cache in chunks",
        versions=">=0.34",
    ),
    Attribute(
        ("vllm.config.kv_transfer",),
        "KVTransferConfig",
        "kv_connector_extra_config",
        "`hooks.runtime.kv_connectors.reads_freed_blocks`: SimpleCPUOffloadConnector's lazy_offload reads free blocks",
        versions=">=0.34",
    ),
    Attribute(
        ("vllm.config.kv_transfer",),
        "KVTransferConfig",
        "kv_connector",
        "`hooks.runtime.kv_connectors.reads_freed_blocks`: the connector, or MultiConnector, that may copy freed blocks",
        versions=">=0.34",
    ),
    Attribute(
        ("vllm.config.kv_transfer",),
        "KVTransferConfig",
        "kv_connector_module_path",
        "`hooks.runtime.kv_connectors.reads_freed_blocks`: a connector from outside vLLM is not audited",
        versions=">=0.34",
    ),
    Attribute(
        ("vllm.config.attention",),
        "AttentionConfig",
        "hisparse_config",
        "`hooks.runtime.extensible_kv_cache.refusal`: HiSparse reads freed blocks, so memory is not returned",
        versions=">=0.34",
    ),
    Attribute(("vllm.v1.core.kv_cache_utils",), "KVCacheBlock", "block_id", _RESIZE_WITHHOLD),
    Attribute(("vllm.v1.core.kv_cache_utils",), "KVCacheBlock", "ref_cnt", _RESIZE_WITHHOLD + "; blocks in use"),
    Attribute(("vllm.v1.core.kv_cache_utils",), "KVCacheBlock", "is_null", _RESIZE_WITHHOLD),
    Attribute(
        ("vllm.v1.core.kv_cache_utils",),
        "KVCacheBlock",
        "prev_free_block",
        "`RuntimeLimit.withhold`: whether a block is in the free queue (a free block outside it is already withheld)",
    ),
    Attribute(
        ("vllm.v1.core.block_pool",),
        "BlockPool",
        "blocks",
        "`RuntimeLimit.shrink`, `RuntimeLimit.give_back`: the blocks by id",
    ),
    Attribute(
        ("vllm.v1.core.block_pool",),
        "BlockPool",
        "enable_caching",
        "`RuntimeLimit.shrink`, `RuntimeLimit.withhold`: whether withheld blocks leave the prefix cache",
    ),
    Attribute(
        ("vllm.v1.core.block_pool",),
        "BlockPool",
        "free_block_queue",
        "`RuntimeLimit.withhold`, `RuntimeLimit.give_back`: the queue the scheduler allocates from",
    ),
    Attribute(
        ("vllm.v1.core.kv_cache_manager",),
        "KVCacheManager",
        "block_pool",
        "`pool_of`: the block pool the limit lives on",
    ),
    Attribute(
        ("vllm.v1.core.sched.scheduler",),
        "Scheduler",
        "kv_cache_manager",
        "`pool_of`, `preempt_above`: the blocks each request holds",
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
        "`preempt_above`: the running requests, those above the limit preempted",
    ),
    Attribute(
        ("vllm.v1.core.sched.scheduler",),
        "Scheduler",
        "prev_step_scheduled_req_ids",
        "`preempt_above`: a preempted request leaves it, as in vLLM's own preemption "
        "(0.34's `_preempt_request` records the preemption itself)",
        versions="<0.34",
    ),
    Attribute(("vllm.v1.request",), "Request", "request_id", "`preempt_above`: the blocks a request holds"),
    Attribute(
        ("vllm.v1.engine.core",),
        "EngineCore",
        "scheduler",
        "`pool_of`, `RuntimeLimit.shrink`: the engine core's scheduler",
    ),
    Attribute(
        ("vllm.v1.engine.core",),
        "EngineCore",
        "model_executor",
        "`_read_allocation`, `worker_pages`: `collective_rpc` to the workers",
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
        "`kv_cache.kv_cache_tensors`: the worker's KV cache tensors (their bytes; their pages, on the CPU backend)",
    ),
    Attribute(
        ("vllm.v1.worker.gpu_model_runner",),
        "GPUModelRunner",
        "kv_caches",
        "`kv_cache.kv_cache_tensors`: the KV cache tensors of the model runner (also the CPU backend's, a subclass); "
        "vLLM 0.34 removed this runner",
        versions="<0.34",
    ),
    Attribute(
        ("vllm.v1.worker.gpu.model_runner",),
        "GPUModelRunner",
        "kv_caches",
        "`kv_cache.kv_cache_tensors`: the same, with the V2 model runner (`VLLM_USE_V2_MODEL_RUNNER`)",
    ),
    Attribute(
        ("vllm.v1.core.sched.scheduler",),
        "Scheduler",
        "requests",
        "`Autoscaler.read_demand`: every unfinished request (running or waiting), whose blocks make the demand",
    ),
    Attribute(("vllm.v1.request",), "Request", "num_tokens", "`Autoscaler.read_demand`: the tokens a request holds"),
    Attribute(
        ("vllm.v1.request",),
        "Request",
        "num_prompt_tokens",
        "`Autoscaler.read_demand`: a request's prompt, with `max_tokens` what it will hold when it finishes",
    ),
    Attribute(
        ("vllm.v1.request",),
        "Request",
        "max_tokens",
        "`Autoscaler.read_demand`: the most tokens a request generates",
    ),
    Attribute(_KV_CACHE_INTERFACE, "KVCacheSpec", "block_size", "`Autoscaler.read_demand`: tokens per block"),
    Attribute(
        ("vllm.v1.engine.core",),
        "EngineCoreProc",
        "input_queue",
        "`wakeups.start_waking`: the queue an idle engine core blocks on, woken with vLLM's own `WAKEUP`",
    ),
    Attribute(
        ("vllm.v1.engine",),
        "EngineCoreRequestType",
        "WAKEUP",
        "`wakeups.start_waking`: the request type an engine core takes off its input queue and ignores",
    ),
    Attribute(("vllm.entrypoints.llm",), "LLM", "llm_engine", _RESIZE_CLIENT),
    Attribute(("vllm.v1.engine.llm_engine",), "LLMEngine", "engine_core", _RESIZE_CLIENT),
    Attribute(("vllm.v1.engine.async_llm",), "AsyncLLM", "engine_core", _RESIZE_CLIENT),
    Attribute(
        ("vllm.v1.engine.core_client",),
        "InprocClient",
        "engine_core",
        "`_call`, `_holding_engine_lock`: the engine core of an `LLM` without a separate engine-core process, "
        "whose autoscaling lock every call holds",
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
"""Attributes run-time resizing (``hooks.runtime``) reads or writes. As
``RESIZE_HOOKS``, optional: where one is missing, resizing refuses naming
it (``hooks.runtime.availability.require_hooks``) and start-up is not affected."""
