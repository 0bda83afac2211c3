"""Step times from aiconfigurator-core (NVIDIA, Apache-2.0; the ``[sim]``
extra): its measured kernel tables of vLLM on h100_sxm, h200_sxm, a100_sxm,
b200_sxm and others, through ``estimate_mixed_step_latency_with_rust``, the
forward-pass model NVIDIA Dynamo's mocker uses.

The package is imported only when this model is asked for, so the
simulator runs without it (with the linear model). A lookup is slow the
first time (its engine is built, about a second) and fast after; the
token counts are rounded up to buckets and the answers kept in an LRU cache.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kv_cache_limit.sim.step_time import Batch, StepTimeError

PACKAGE = "aiconfigurator_core"
INSTALL_HINT = 'pip install "vllm-kv-cache-limit[sim]" (or: pip install aiconfigurator-core)'
CACHE_SIZE = 65536


def bucket(tokens: int) -> int:
    """``tokens`` rounded up to a bucket: exact up to 16, then to 1/16 of its power of two."""
    if tokens <= 16:
        return max(0, int(tokens))
    step = 1 << max(0, int(tokens).bit_length() - 5)
    return -(-int(tokens) // step) * step


def shipped_configs() -> Path | None:
    """aiconfigurator-core's folder of Hugging Face configs (``Org--Name_config.json``), found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "model_configs"
    return folder if folder.is_dir() else None


def cache_folder() -> Path:
    """Where model folders made from shipped configs are kept: ``$XDG_CACHE_HOME/vllm-kv-sim`` (``~/.cache``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-kv-sim"


def model_folder(name: str, configs: Path | None = None, cache: Path | None = None) -> str | None:
    """A model folder holding the ``config.json`` aiconfigurator-core ships
    for the Hugging Face name ``name`` (``Qwen/Qwen3-8B``), no weights: what
    vLLM reads the KV cache's shape from. None when ``name`` is a local
    folder already, or no config is shipped for it. The file is written
    whole (a new file renamed over the old one, never through a link) and
    reused while its content is the same."""
    if os.path.isdir(name) or "/" not in name:
        return None
    configs = configs if configs is not None else shipped_configs()
    if configs is None:
        return None
    source = configs / f"{name.replace('/', '--')}_config.json"
    if not source.is_file():
        return None
    content = source.read_bytes()
    folder = (cache if cache is not None else cache_folder()) / "models" / name.replace("/", "--")
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    target = folder / "config.json"
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        fd = -1
    if fd >= 0:
        with os.fdopen(fd, "rb") as existing:
            if existing.read() == content:
                return str(folder)
    partial = folder / f".config.json.{os.getpid()}"
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as file:
            file.write(content)
        os.replace(partial, target)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise StepTimeError(
            f"cannot write {target} from aiconfigurator-core's config for {name!r} ({exc.strerror}); set "
            "XDG_CACHE_HOME to a folder you can write, or give model= a local folder holding the model's config.json."
        ) from None
    return str(folder)


def available() -> bool:
    """Whether aiconfigurator-core can be imported here."""
    try:
        import aiconfigurator_core.sdk.rust_engine_step  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class AiconfiguratorStepTime:
    """One model on one system, as aiconfigurator-core's tables time it:
    ``model`` a Hugging Face name it ships a config for (``Qwen/Qwen3-8B``),
    ``system`` one of its systems (``h100_sxm``), ``version`` the vLLM
    version of its tables (``0.24.0``)."""

    model: str
    system: str = "h100_sxm"
    version: str = "0.24.0"
    osl: int = 256
    """The output length the tables are read at (the decode attention's
    context is the batch's own mean; this only sets the step's mode)."""
    name: str = "aiconfigurator"
    _lookup: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            from aiconfigurator_core.sdk.config import ModelConfig
            from aiconfigurator_core.sdk.models import get_model
            from aiconfigurator_core.sdk.perf_database import get_database
            from aiconfigurator_core.sdk.rust_engine_step import estimate_mixed_step_latency_with_rust
        except ImportError as exc:
            raise StepTimeError(
                f"the aiconfigurator step time needs aiconfigurator-core, which is not importable here ({exc}); "
                f"install it with {INSTALL_HINT}, or give a linear step time (--step-time a=...,b=...,c=...)."
            ) from None
        try:
            model = get_model(self.model, ModelConfig(), "vllm")
            database = get_database(self.system, "vllm", self.version)
        except Exception as exc:
            raise StepTimeError(
                f"aiconfigurator-core has no tables for model {self.model!r} on {self.system!r} with vLLM "
                f"{self.version!r} ({type(exc).__name__}: {exc}); give a model it ships a config for (for "
                "example Qwen/Qwen3-8B) and a system it has data for (for example h100_sxm, vLLM 0.24.0)."
            ) from None
        if database is None:
            raise StepTimeError(
                f"aiconfigurator-core has no vLLM {self.version!r} tables for {self.system!r}; for example "
                "h100_sxm with vLLM 0.24.0 has them."
            )

        @functools.lru_cache(maxsize=CACHE_SIZE)
        def lookup(ctx_tokens: int, gen_tokens: int, isl: int) -> float:
            milliseconds = estimate_mixed_step_latency_with_rust(
                model, database, ctx_tokens=ctx_tokens, gen_tokens=gen_tokens, isl=isl, osl=self.osl, prefix=0
            )
            return float(milliseconds) / 1000.0

        self._lookup = lookup

    def seconds(self, batch: Batch) -> float:
        if batch.empty:
            return 0.0
        gen = batch.decode_requests
        context = batch.decode_context_tokens // gen if gen else batch.prefill_tokens
        return self._lookup(bucket(batch.prefill_tokens), bucket(gen), bucket(max(1, context)))

    def describe(self) -> str:
        info = self._lookup.cache_info()
        return (
            f"aiconfigurator-core: {self.model} on {self.system} (vLLM {self.version} tables; "
            f"{info.currsize} lookups cached)"
        )
