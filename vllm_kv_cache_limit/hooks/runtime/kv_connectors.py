"""Which of vLLM's KV connectors touch KV blocks after the scheduler freed
them, where a run-time limit on vLLM 0.34's extensible KV cache would
unmap the memory under their copies (``docs/resize.md`` has the audit of
every connector in vLLM 0.34).

A connector is safe here when everything it reads or writes in the device
KV cache is done within the step that scheduled it (the release waits for
the device), or when it keeps the blocks it still copies out of the free
queue (``request_finished`` returning True, or a reference held on them) so
that a drain waits for it.
"""

from __future__ import annotations

from typing import Any

READS_FREED_BLOCKS = {
    "OffloadingConnector": (
        "the KV connector OffloadingConnector (--kv-offloading-size) stores a finished request's blocks to the "
        "CPU from the step after the scheduler freed them, holding nothing on them, so their memory could be "
        "unmapped under the copy"
    ),
    "HiSparseConnector": "the KV connector HiSparseConnector reads unpinned blocks after they are freed",
}
"""Connector name -> why it touches blocks the scheduler freed."""

OUTSIDE_VLLM = {
    "FlexKVConnectorV1": "the flexkv package",
    "LMCacheConnectorV1": "the lmcache package (without use_native)",
}
"""Connector name -> the package whose code copies the blocks (not audited here)."""


def _children(transfer: Any) -> list[dict[str, Any]]:
    """The connectors configured: MultiConnector's children, or the one."""
    if transfer.kv_connector == "MultiConnector":
        return [c for c in (transfer.kv_connector_extra_config or {}).get("connectors", []) if isinstance(c, dict)]
    return [
        {
            "kv_connector": transfer.kv_connector,
            "kv_connector_module_path": transfer.kv_connector_module_path,
            "kv_connector_extra_config": transfer.kv_connector_extra_config,
        }
    ]


def reads_freed_blocks(transfer: Any) -> str | None:
    """Why a configured connector (alone or in a MultiConnector) may touch
    KV blocks after the scheduler freed them, or None. A connector loaded
    from a module outside vLLM (``kv_connector_module_path``), or whose
    copies are another package's code, is not known here: it counts as one
    that may (fail closed)."""
    if transfer is None or transfer.kv_connector is None:
        return None
    if transfer.has_connector("SimpleCPUOffloadConnector") and _lazy_offload(transfer):
        return "SimpleCPUOffloadConnector with lazy_offload copies cached blocks from the free queue"
    for child in _children(transfer):
        name = child.get("kv_connector")
        module = child.get("kv_connector_module_path")
        if module:
            return (
                f"the KV connector {name!r} comes from the module {module!r}, outside vLLM, and whether it copies "
                "KV blocks after the scheduler freed them is not known"
            )
        if name in READS_FREED_BLOCKS:
            return READS_FREED_BLOCKS[name]
        native = (child.get("kv_connector_extra_config") or {}).get("use_native")
        if name in OUTSIDE_VLLM and not (name == "LMCacheConnectorV1" and native):
            return (
                f"the KV connector {name} copies KV blocks with code from {OUTSIDE_VLLM[name]}, outside vLLM, "
                "and whether it does so after the scheduler freed them is not known"
            )
    return None


def _lazy_offload(transfer: Any) -> bool:
    """Whether a SimpleCPUOffloadConnector (alone or in a MultiConnector) offloads lazily."""
    configs = [transfer.kv_connector_extra_config or {}]
    configs += [c for c in configs[0].get("connectors", []) if isinstance(c, dict)]
    return any(c.get("lazy_offload") or (c.get("kv_connector_extra_config") or {}).get("lazy_offload") for c in configs)
