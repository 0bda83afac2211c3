"""An engine core started with a cap announces itself in the lock folder
(``logic.instance_entries``) once its KV cache is allocated, until it shuts down or
dies; its server tells it where its status can be read. The announcement
is kept on the engine core's ``EngineCoreState``.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.config import cap_of
from vllm_kv_cache_limit.hooks.devices import instance_devices
from vllm_kv_cache_limit.hooks.runtime.limit import EngineCoreState
from vllm_kv_cache_limit.logic import instance_entries, startup_lock

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


def model_name(model_config: Any) -> str:
    """The name clients use for the model (the first served name), else its path."""
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or model_config.model)


def start(engine_core: Any, vllm_config: Any, folder: str | None = None) -> None:
    """Announce a capped engine core (autoscaled or not); never raises into
    vLLM: an instance that cannot announce itself runs, unlisted."""
    cap = cap_of(vllm_config.cache_config)
    if cap is None:
        return
    try:
        state = EngineCoreState.of(engine_core)
        scaler = state.autoscaler
        devices, _ = instance_devices(vllm_config)
        bpb = scaler.allocation.bytes_per_block if scaler is not None else 0
        entry = instance_entries.record(
            [(d.key, d.label) for d in devices],
            model_name(vllm_config.model_config),
            cap,
            floor=None if scaler is None else scaler.floor * bpb,
            autoscale=scaler is not None,
            budget=None if scaler is None else scaler.budget,
        )
        state.announcement = instance_entries.Announcement(startup_lock.lock_dir() if folder is None else folder, entry)
    except Exception as exc:
        logger.warning("This instance is not listed for vllm-kv-top: its entry in the lock folder failed (%s).", exc)


def set_status_url(engine_core: Any, url: str) -> dict[str, Any]:
    """The ``kv_cache_limit_announce`` utility method: the server's status
    route, written into the engine core's entry."""
    state = EngineCoreState.peek(engine_core)
    announcement = None if state is None else state.announcement
    if announcement is None:
        return {"announced": False}
    try:
        announcement.update(status_url=url)
    except OSError as exc:
        logger.warning("The status URL could not be written into this instance's entry (%s).", exc)
        return {"announced": False}
    return {"announced": True}


def stop(engine_core: Any) -> None:
    """Remove the engine core's entry (it shuts down)."""
    state = EngineCoreState.peek(engine_core)
    if state is not None and state.announcement is not None:
        announcement, state.announcement = state.announcement, None
        announcement.close()
