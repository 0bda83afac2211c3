"""The generated tables of docs/compatibility.md (``scripts/check_hooks.py
--write-docs``; a test compares).
"""

from __future__ import annotations

from vllm_kv_cache_limit.compat import registry
from vllm_kv_cache_limit.compat.attributes import ATTRIBUTES, RESIZE_ATTRIBUTES


def hooks_table() -> str:
    """The Markdown table of ``HOOKS`` and ``RESIZE_HOOKS`` in docs/compatibility.md (generated:
    ``python scripts/check_hooks.py --write-docs``; a test compares)."""
    rows = [
        "| vLLM function | parameters relied on | releases | plugin wrapper | upstream change that would retire it | remove when |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    cap, resize = registry.cap_hooks(), registry.resize_hooks()
    for hook in cap + resize:
        where = " or ".join(f"`{m}`" for m in hook.modules)
        params = ", ".join(f"`{p}`" for p in hook.params) or "(any)"
        wrapper = f"`{hook.wrapper_name}`" if hook.wrapper else "(called, not wrapped)"
        if hook in resize:
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
