"""Every place ``vllm-kv-sim`` touches vLLM: the functions and constructors
it calls (``HOOKS``: it wraps none) and the fields it reads or sets
(``ATTRIBUTES``), as the plugin's own hooks are recorded (``compat``). The
registry finds this module in ``sim/`` by its ``HOOKS`` (from its source,
nothing imported), ``scripts/check_hooks.py`` checks the entries against
every wheel of the window, and a test ties them to the simulator's vLLM
imports. Importing it imports no vLLM.
"""

from __future__ import annotations

from vllm_kv_cache_limit.compat.entries import Attribute, Hook

_CONFIG = "vllm.config"
_INTERFACE = ("vllm.v1.kv_cache_interface",)

HOOKS = (
    # The configs an engine core is built from, as vLLM's tests/v1/core/utils.py builds them (instance.py).
    # vLLM's config classes (``@config``, fields as keywords: each keyword is an ``ATTRIBUTES`` entry).
    Hook(("vllm.config.model", _CONFIG), "ModelConfig"),
    Hook(("vllm.config.scheduler", _CONFIG), "SchedulerConfig"),
    Hook(("vllm.config.cache", _CONFIG), "CacheConfig"),
    Hook(("vllm.config.parallel", _CONFIG), "ParallelConfig"),
    Hook(("vllm.config.vllm", _CONFIG), "VllmConfig"),
    Hook(("vllm.config.model", _CONFIG), "ModelConfig.get_num_kv_heads", ("self", "parallel_config")),
    Hook(("vllm.config.model", _CONFIG), "ModelConfig.get_head_size", ("self",)),
    Hook(("vllm.config.model", _CONFIG), "ModelConfig.get_num_layers", ("self", "parallel_config")),
    # The KV cache: its shape, its config and vLLM's scheduler over it.
    Hook(_INTERFACE, "FullAttentionSpec.__init__"),
    Hook(_INTERFACE, "KVCacheConfig.__init__"),
    Hook(_INTERFACE, "KVCacheGroupSpec.__init__"),
    Hook(("vllm.v1.core.single_type_kv_cache_manager",), "register_all_kvcache_specs", ("vllm_config",)),
    Hook(("vllm.v1.core.kv_cache_utils",), "init_none_hash", ("hash_fn",)),
    Hook(("vllm.v1.core.kv_cache_utils",), "get_request_block_hasher", ("hash_block_size", "caching_hash_fn")),
    Hook(("vllm.utils.hashing",), "sha256", ("input",)),
    Hook(
        ("vllm.v1.core.sched.scheduler",),
        "Scheduler.__init__",
        ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size"),
    ),
    Hook(("vllm.v1.core.sched.scheduler",), "Scheduler.add_request", ("self", "request")),
    Hook(("vllm.v1.core.sched.scheduler",), "Scheduler.has_requests", ("self",)),
    Hook(("vllm.v1.structured_output",), "StructuredOutputManager.__init__", ("self", "vllm_config")),
    Hook(("vllm.v1.core.block_pool",), "BlockPool.get_num_free_blocks", ("self",)),
    # The engine core, built without __init__ (no processes, no model): its step, the executor replaced.
    Hook(("vllm.v1.engine.core",), "EngineCore.step", ("self",)),
    # Each arrival: its request and sampling parameters; each step's answer.
    Hook(
        ("vllm.v1.request",),
        "Request.__init__",
        ("self", "request_id", "prompt_token_ids", "sampling_params", "pooling_params"),
    ),
    Hook(("vllm.sampling_params",), "SamplingParams.update_from_generation_config", ("self", "generation_config")),
    Hook(("vllm.v1.outputs",), "ModelRunnerOutput.__init__"),
    # The calibration's real engine (calibrate.py).
    Hook(("vllm.entrypoints.llm",), "LLM"),
)
"""vLLM functions and constructors ``vllm-kv-sim`` calls (it wraps none):
checked by ``scripts/check_hooks.py`` beside the plugin's hooks, never at an
engine's start-up (the plugin does not depend on them)."""

_FIELDS: tuple[tuple[str, str, str, str], ...] = (
    ("vllm.config.model", "ModelConfig", "model", "`build_engine_core`: the model folder (its config.json)"),
    ("vllm.config.model", "ModelConfig", "seed", "`build_engine_core`: a keyword of its config"),
    ("vllm.config.model", "ModelConfig", "max_model_len", "`build_engine_core`: the instance's max_model_len"),
    ("vllm.config.model", "ModelConfig", "skip_tokenizer_init", "`build_engine_core`: no tokenizer is built"),
    ("vllm.config.model", "ModelConfig", "is_encoder_decoder", "`build_engine_core`: the scheduler config's"),
    ("vllm.config.model", "ModelConfig", "dtype", "`build_engine_core`: the KV cache's dtype"),
    ("vllm.config.scheduler", "SchedulerConfig", "max_num_seqs", "`build_engine_core`: the instance's batch"),
    ("vllm.config.scheduler", "SchedulerConfig", "max_num_batched_tokens", "`build_engine_core`: a step's tokens"),
    ("vllm.config.scheduler", "SchedulerConfig", "enable_chunked_prefill", "`build_engine_core`: chunked prefill on"),
    ("vllm.config.scheduler", "SchedulerConfig", "max_model_len", "`build_engine_core`: a keyword of its config"),
    ("vllm.config.scheduler", "SchedulerConfig", "is_encoder_decoder", "`build_engine_core`: the model's"),
    ("vllm.config.scheduler", "SchedulerConfig", "watermark", "`build_engine_core`: no watermark"),
    ("vllm.config.cache", "CacheConfig", "gpu_memory_utilization", "`build_engine_core`: a keyword of its config"),
    ("vllm.config.cache", "CacheConfig", "cache_dtype", "`build_engine_core`: the model's dtype"),
    ("vllm.config.vllm", "VllmConfig", "model_config", "`build_engine_core`: a keyword of the engine's config"),
    ("vllm.config.vllm", "VllmConfig", "scheduler_config", "`build_engine_core`: likewise"),
    ("vllm.config.vllm", "VllmConfig", "parallel_config", "`build_engine_core`: likewise"),
    ("vllm.config.vllm", "VllmConfig", "cache_config", "`build_engine_core`, the scenarios: the cache's settings"),
    ("vllm.config.cache", "CacheConfig", "enable_prefix_caching", "`build_engine_core`: prefix caching off"),
    ("vllm.config.cache", "CacheConfig", "block_size", "`build_engine_core`: the block size"),
    ("vllm.v1.kv_cache_interface", "AttentionSpec", "page_size_bytes", "`build_engine_core`: a block's bytes"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "requests", "`SimExecutor.execute_model`: the batch's requests"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "waiting", "`Instance.sample`: the queue in the timeline"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "kv_cache_manager", "`Instance.sample`: the block pool"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "block_pool", "`Instance.sample`: blocks in use"),
    ("vllm.v1.core.block_pool", "BlockPool", "num_gpu_blocks", "`Instance.limit_blocks`: the whole allocation"),
    ("vllm.v1.core.block_pool", "BlockPool", "free_block_queue", "`Instance.sample`: the free blocks"),
    ("vllm.v1.engine.core", "EngineCore", "scheduler", "`build_engine_core`: set on a core built without __init__"),
    ("vllm.v1.engine.core", "EngineCore", "vllm_config", "`build_engine_core`: set likewise"),
    ("vllm.v1.engine.core", "EngineCore", "model_executor", "`build_engine_core`: the simulated executor"),
    ("vllm.v1.engine.core", "EngineCore", "log_stats", "`build_engine_core`: set likewise"),
    ("vllm.v1.engine.core", "EngineCore", "aborts_queue", "`build_engine_core`: set likewise"),
    ("vllm.v1.core.sched.output", "SchedulerOutput", "num_scheduled_tokens", "`SimExecutor.execute_model`"),
    ("vllm.v1.request", "Request", "num_computed_tokens", "`SimExecutor.execute_model`: prefill or decode"),
    ("vllm.v1.request", "Request", "num_tokens", "`SimExecutor.execute_model`: prefill or decode"),
    ("vllm.v1.request", "Request", "num_preemptions", "`Instance.preemptions`"),
    ("vllm.v1.outputs", "ModelRunnerOutput", "req_ids", "`SimExecutor.execute_model`: the batch's rows"),
    ("vllm.v1.outputs", "ModelRunnerOutput", "sampled_token_ids", "`SimExecutor.execute_model`: one token a row"),
    ("vllm.v1.engine", "EngineCoreOutputs", "outputs", "`Instance.step`: each request's new tokens"),
    ("vllm.v1.engine", "EngineCoreOutput", "request_id", "`Instance.step`"),
    ("vllm.v1.engine", "EngineCoreOutput", "new_token_ids", "`Instance.step`: the first token's time"),
    ("vllm.v1.engine", "EngineCoreOutput", "finish_reason", "`Instance.step`: the request's end"),
)

ATTRIBUTES = (
    # The calibration's real engine and its prompts (calibrate.py).
    Attribute(("vllm.inputs",), "", "TokensPrompt", "vllm-kv-sim calibrate: prompts of token ids"),
    *(Attribute((module,), owner, attr, f"vllm-kv-sim {why}") for module, owner, attr, why in _FIELDS),
    Attribute(
        ("vllm.v1.outputs",),
        "ModelRunnerOutput",
        "req_id_to_index",
        "vllm-kv-sim `SimExecutor.execute_model`: each request's row (0.34 reads req_ids)",
        versions="<0.34",
    ),
    Attribute(
        ("vllm.v1.engine.core",),
        "EngineCore",
        "_weight_version",
        "vllm-kv-sim `build_engine_core`: set on a core built without __init__",
    ),
)
"""Fields of vLLM objects ``vllm-kv-sim`` reads or sets: checked beside ``HOOKS``."""
