"""Activate the plugin's hooks as soon as the vLLM modules they patch load.

vLLM loads general plugins inside ``EngineArgs.__post_init__``; by then
``LLM(model, kv_cache_max_memory=...)`` has already failed on the unknown
keyword. So the package installs ``vllm_kv_cache_limit.pth`` into
site-packages, which calls :func:`install_from_site` at interpreter start-up.
That only puts a small finder on ``sys.meta_path``; nothing is imported until
a patched vLLM module itself is imported, and then its hook runs right after
the module body. ``register()`` (the general plugin) calls :func:`install`
too, so the hooks are also active where the ``.pth`` file is not processed.

No vLLM import here: this module is imported by every interpreter start-up
in the environment.
"""

from __future__ import annotations

# Only modules Python has loaded before `site` runs: this module is imported
# at every interpreter start-up (typing, threading and importlib.abc would
# cost milliseconds each time).
import _thread
import importlib
import os
import sys
import types  # already loaded by the interpreter's start-up

PLUGIN_NAME = "vllm_kv_cache_limit"
"""The entry point name, as listed in ``VLLM_PLUGINS``."""

HOOKED_MODULES: dict[str, tuple[str, ...]] = {
    "vllm.engine.arg_utils": ("hooks.cap.arg_utils:patch",),
    "vllm.config.compilation": ("hooks.cap.compilation:patch",),
    "vllm.v1.engine.core": ("hooks.cap.engine_core:patch", "hooks.runtime.engine_core:patch"),
    "vllm.v1.engine.utils": ("hooks.cap.engine_utils:patch",),
    "vllm.v1.worker.gpu_worker": ("hooks.cap.gpu_worker:patch",),
    "vllm.v1.worker.cpu_worker": ("hooks.cap.cpu_worker:patch",),
    "vllm.v1.core.block_pool": ("hooks.runtime.block_pool:patch",),
    "vllm.v1.worker.worker_base": ("hooks.runtime.worker:patch",),
    "vllm.utils.extensible_tensor": ("hooks.runtime.extensible_tensor:patch",),  # vLLM 0.34
    "vllm.v1.worker.extensible_kv_cache": ("hooks.runtime.extensible_kv_cache:patch",),  # vLLM 0.34
    "vllm.v1.engine.core_client": ("hooks.runtime.client:patch",),
    "vllm.entrypoints.common.cli_args": ("hooks.runtime.server:patch_arg_parser",),  # vLLM 0.33
    "vllm.entrypoints.launchers.cli_args": ("hooks.runtime.server:patch_arg_parser",),  # vLLM 0.29-0.32
    "vllm.entrypoints.launchers.app": ("hooks.runtime.server:patch_app",),
}
"""vLLM module -> the patch functions (``module:function`` under this
package) its import runs: ``compat.registry.targets()`` written out, so that
interpreter start-up imports nothing (a test compares the two)."""

_lock = _thread.RLock()
_done: set[str] = set()
_installed = False
failed: dict[str, str] = {}
"""Hooked vLLM module -> why its hook could not be installed. With a cap in
force start-up stops on any entry (fail closed)."""


def plugin_allowed(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether ``VLLM_PLUGINS`` lets this plugin load (unset: all plugins)."""
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is None:
        return True
    return PLUGIN_NAME in [name.strip() for name in allowed.split(",")]


def _run_hook(module: types.ModuleType) -> None:
    with _lock:
        if module.__name__ in _done:
            return
        _done.add(module.__name__)
    for target in HOOKED_MODULES[module.__name__]:
        _run_patch(module, target)


def _run_patch(module: types.ModuleType, target: str) -> None:
    where, _, function = target.partition(":")
    try:
        getattr(importlib.import_module(f"{PLUGIN_NAME}.{where}"), function)(module)
    except Exception as exc:
        from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError

        if isinstance(exc, KVCacheMaxMemoryError):
            raise  # a cap is in force and cannot be enforced: stop
        failed[module.__name__] = f"{target} on {module.__name__} failed: {exc!r}"
        # Fail closed (logic.fail_closed): with a cap in force, stop.
        from vllm_kv_cache_limit import compat

        compat.stop_if_capped([failed[module.__name__]])
        # Without a cap, never break the import of a vLLM module.
        import logging

        logging.getLogger("vllm.plugins.kv_cache_limit").warning(
            "vllm-kv-cache-limit could not hook %s (%r); the plugin is inactive "
            "for it, and --kv-cache-max-memory would stop start-up.",
            module.__name__,
            exc,
        )


class _HookLoader:
    """Delegates to the real loader, then runs the module's hook."""

    # The loaders are typed loosely: importlib.abc would cost milliseconds at
    # every interpreter start-up.
    def __init__(self, loader: object) -> None:
        self._loader: types.SimpleNamespace = loader  # type: ignore[assignment]

    def __getattr__(self, name: str):
        return getattr(self._loader, name)

    def create_module(self, spec: object):
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # Give the module its real loader back: inspect and pickle look at it.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader  # type: ignore[assignment]
        self._loader.exec_module(module)
        _run_hook(module)


class _PostImportFinder:
    """Finds hooked vLLM modules through the other finders and wraps their
    loader so the hook runs once the module body has executed."""

    def __init__(self) -> None:
        self._busy = _thread._local()

    def find_spec(self, fullname: str, path=None, target=None) -> object:
        if fullname not in HOOKED_MODULES or fullname in _done:
            return None
        busy = getattr(self._busy, "names", None)
        if busy is None:
            busy = self._busy.names = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookLoader(spec.loader)  # type: ignore[assignment]
        return spec


def install() -> None:
    """Install the hooks once per process: now for the hooked modules already
    imported, at import time for the others."""
    global _installed
    with _lock:
        if not _installed:
            _installed = True
            sys.meta_path.insert(0, _PostImportFinder())  # type: ignore[arg-type]
    for name in HOOKED_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            _run_hook(module)


def install_from_site() -> None:
    """Called by ``vllm_kv_cache_limit.pth`` at interpreter start-up. Honours
    ``VLLM_PLUGINS`` and never lets an error break start-up."""
    try:
        if plugin_allowed():
            install()
    except Exception:  # pragma: no cover - start-up must survive anything
        pass
