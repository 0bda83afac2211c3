"""vllm.engine.arg_utils: the engine argument, the CLI flag and the cap in the
engine config (checked against the device before anything loads).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.config import AUTOSCALE_FIELDS, FIELD, KVCacheLimitConfig
from vllm_kv_cache_limit.hooks.apply import hook_ok
from vllm_kv_cache_limit.hooks.devices import check_fits_before_load, device_total_memory
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic import envs, startup_lock
from vllm_kv_cache_limit.logic.autoscale_policy import (
    AUTOSCALE_FLAG,
    MIN_MEMORY_FLAG,
    SHARED_BUDGET_FLAG,
    check_executor,
    check_settings,
    lazy_release,
    shrink_after_s,
)
from vllm_kv_cache_limit.logic.cap_decision import (
    ENV_VAR,
    FLAG,
    cap_explicit_size,
    check_cap_holds_a_block,
    check_cap_within_total,
    resolve_cap,
)
from vllm_kv_cache_limit.logic.errors import UnsupportedVLLMError
from vllm_kv_cache_limit.logic.relay import arm_error_relay
from vllm_kv_cache_limit.logic.sizes import argparse_size, parse_size

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


def patch(module: Any) -> None:
    """Add ``kv_cache_max_memory`` to ``EngineArgs`` (and its subclasses such
    as ``AsyncEngineArgs``), to the CLI, and to the engine config."""
    engine_args = module.EngineArgs
    if not hook_ok(ENGINE_ARGS_INIT):
        return
    for cls in _with_subclasses(engine_args):
        # Dataclass subclasses have their own generated __init__ and fields.
        if "__init__" in cls.__dict__ and "__dataclass_fields__" in cls.__dict__:
            add_engine_args_field(cls)
    if hook_ok(ENGINE_ARGS_ADD_CLI_ARGS) and hook_ok(GET_ATTR_DOCS):  # the flags' help comes from get_attr_docs
        wrap(engine_args, "add_cli_args", _add_cli_flag, static=True)
    if hook_ok(ENGINE_ARGS_CREATE_ENGINE_CONFIG):
        wrap(engine_args, "create_engine_config", _carry_cap_into_config)


def _with_subclasses(cls: type) -> list[type]:
    found, stack = [], [cls]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(current.__subclasses__())
    return found


def _parse_bool(name: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"Invalid {name} {value!r}: expected True or False.")
        return value

    return parse


ENGINE_FIELDS: dict[str, tuple[Any, str, Callable[[Any], Any]]] = {
    FIELD: (None, "str | int | None", parse_size),
    "kv_cache_autoscale": (False, "bool", _parse_bool("kv_cache_autoscale")),
    "kv_cache_min_memory": (None, "str | int | None", parse_size),
    "kv_cache_shared_budget": (None, "str | int | None", parse_size),
}
"""The plugin's ``EngineArgs`` fields: default, annotation, and the parser
of a value given (``LLM(...)`` keywords and the CLI both pass through it)."""


def add_engine_args_field(cls: type) -> None:
    """Why: ``LLM(model, kv_cache_max_memory=...)`` passes its keywords to
    ``EngineArgs(**kwargs)``, ``from_cli_args`` copies the dataclass fields
    from the parsed CLI, and ``vllm bench`` rebuilds ``LLM`` from
    ``dataclasses.asdict(engine_args)``; all need real dataclass fields.
    How: registers the plugin's fields (``ENGINE_FIELDS``) on the existing
    class and wraps its generated ``__init__`` to accept, validate and store
    their keywords."""
    if FIELD in cls.__dict__.get("__dataclass_fields__", {}):
        return
    for name, (default, annotation, _) in ENGINE_FIELDS.items():
        field: dataclasses.Field[Any] = dataclasses.field(default=default)
        field.name = name
        field.type = annotation
        field._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
        cls.__dataclass_fields__[name] = field  # type: ignore[attr-defined]
        setattr(cls, name, default)

    def make(original_init: Callable) -> Callable:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for name, (default, _, parse) in ENGINE_FIELDS.items():
                value = kwargs.pop(name, default)
                setattr(self, name, value if value is None or value is default else parse(value))
            original_init(self, *args, **kwargs)

        return __init__

    wrap(cls, "__init__", make)


def _flag_help(field: str = FIELD) -> str:
    # The help is the field's docstring, read as vLLM reads its config fields.
    from vllm.config.utils import get_attr_docs

    # argparse expands %-formats in help texts.
    return get_attr_docs(KVCacheLimitConfig)[field].replace("%", "%%")


def _add_cli_flag(original: Callable) -> Callable:
    """Why: every entry point that builds engine arguments (serve, the
    api_server module, bench, run-batch) calls ``EngineArgs.add_cli_args``.
    How: after the original, adds ``--kv-cache-max-memory`` to its
    ``CacheConfig`` group."""

    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original(parser, *args, **kwargs)
        if any(FLAG in action.option_strings for action in parser._actions):
            return parser
        group = next((g for g in parser._action_groups if g.title == "CacheConfig"), parser)
        group.add_argument(
            FLAG,
            dest=FIELD,
            type=argparse_size,
            default=None,
            metavar="SIZE",
            help=_flag_help(),
        )
        group.add_argument(
            AUTOSCALE_FLAG,
            dest="kv_cache_autoscale",
            action=argparse.BooleanOptionalAction,
            default=False,
            help=_flag_help("kv_cache_autoscale"),
        )
        for flag, field in ((MIN_MEMORY_FLAG, "kv_cache_min_memory"), (SHARED_BUDGET_FLAG, "kv_cache_shared_budget")):
            group.add_argument(
                flag, dest=field, type=argparse_size, default=None, metavar="SIZE", help=_flag_help(field)
            )
        return parser

    return add_cli_args


def _carry_cap_into_config(original: Callable) -> Callable:
    """Why: the cap must reach the engine core and every worker.
    How: resolves the cap (argument, else ``VLLM_KV_CACHE_MAX_MEMORY``),
    refuses one below a KV cache block of any model (``8 G`` unquoted) or
    above the device's total memory before anything loads, calls the
    original, then sets ``cache_config.kv_cache_max_memory`` (pickled to
    every process; shown by ``CacheConfig.metrics_info``) and reduces an
    explicit ``kv_cache_memory_bytes`` above the cap."""

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        register_environment_variables()
        cap = resolve_cap(getattr(self, FIELD, None), os.environ.get(ENV_VAR))
        scaling = {name: getattr(self, name, None) for name in AUTOSCALE_FIELDS}
        check_settings(
            cap, bool(scaling["kv_cache_autoscale"]), scaling["kv_cache_min_memory"], scaling["kv_cache_shared_budget"]
        )
        if scaling["kv_cache_autoscale"]:
            shrink_after_s()  # a bad value fails here, quoted
            lazy_release()
        if cap is not None:
            check_cap_holds_a_block(cap, getattr(self, "block_size", None))
        if cap is None:
            # No cap in force for the processes this engine starts.
            os.environ.pop(envs.ERROR_FILE, None)
            return original(self, *args, **kwargs)
        from vllm_kv_cache_limit import _bootstrap

        # Fail closed (logic.fail_closed): the cap is in force from here on.
        if _bootstrap.failed:
            raise UnsupportedVLLMError(compat.drift_message(sorted(_bootstrap.failed.values())))
        total, device = device_total_memory()
        check_cap_within_total(cap, total, device)
        problems = compat.check_hooks_at_startup()
        if problems:
            raise UnsupportedVLLMError(compat.drift_message(problems))
        startup_lock.lock_timeout()  # a bad value fails here, quoted
        config = original(self, *args, **kwargs)
        parallel_config = config.parallel_config
        check_executor(
            bool(scaling["kv_cache_autoscale"]),
            parallel_config.distributed_executor_backend,
            parallel_config.tensor_parallel_size * parallel_config.pipeline_parallel_size,
        )
        cache_config = config.cache_config
        setattr(cache_config, FIELD, cap)
        for name, value in scaling.items():
            setattr(cache_config, name, value)
        reduced, warning = cap_explicit_size(cache_config.kv_cache_memory_bytes, cap)
        if warning:
            logger.warning(warning)
            cache_config.kv_cache_memory_bytes = reduced
        check_fits_before_load(config, cap)
        arm_error_relay()
        return config

    return create_engine_config


def register_environment_variables() -> None:
    """Why: vLLM checks every ``VLLM_*`` variable against its own table when
    it builds the engine config (``validate_environ``), and warns about, or
    with ``--fail-on-environ-validation`` refuses, the plugin's. How: adds
    the plugin's variables that are set to ``vllm.envs.environment_variables``
    before the original runs. Upstream: the variables in ``vllm.envs``."""
    import vllm.envs

    table = getattr(vllm.envs, "environment_variables", None)
    if table is None:
        # Renamed in vLLM: without a cap vLLM runs untouched; with one, the
        # start-up check names the missing attribute (compat.ATTRIBUTES).
        return
    envs.register_with_vllm(table)


ENGINE_ARGS_INIT = Hook(
    ("vllm.engine.arg_utils",),
    "EngineArgs.__init__",
    wrapper=add_engine_args_field,
    upstream="none yet: an `EngineArgs.kv_cache_max_memory` field",
    remove_when="vLLM has the field in every supported release",
)

ENGINE_ARGS_ADD_CLI_ARGS = Hook(
    ("vllm.engine.arg_utils",),
    "EngineArgs.add_cli_args",
    ("parser",),
    wrapper=_add_cli_flag,
    upstream="none yet: a `CacheConfig.kv_cache_max_memory` field (the flag follows from it)",
    remove_when="vLLM has the field in every supported release",
)

ENGINE_ARGS_CREATE_ENGINE_CONFIG = Hook(
    ("vllm.engine.arg_utils",),
    "EngineArgs.create_engine_config",
    ("self",),
    wrapper=_carry_cap_into_config,
    upstream="none yet: the field and its checks in `VllmConfig.__post_init__`",
    remove_when="vLLM carries and checks the cap itself",
)

# Called, not wrapped: the flags' help, read from ``KVCacheLimitConfig`` as
# vLLM reads its config fields' (``_flag_help``).
GET_ATTR_DOCS = Hook(("vllm.config.utils",), "get_attr_docs", ("cls",))

HOOKS = (ENGINE_ARGS_INIT, ENGINE_ARGS_ADD_CLI_ARGS, ENGINE_ARGS_CREATE_ENGINE_CONFIG, GET_ATTR_DOCS)

TARGETS = {"vllm.engine.arg_utils": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
