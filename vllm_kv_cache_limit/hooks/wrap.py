"""Replace a vLLM function by a wrapper around it, once.

A leaf: imports nothing of the package.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

WRAPPED = "__vllm_kv_cache_limit_wrapped__"


def wrap(owner: Any, name: str, make: Callable[[Callable], Callable], static: bool = False) -> None:
    """Replace ``owner.name`` by ``make(original)``, once."""
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    if isinstance(original, staticmethod):
        original = original.__func__
    if getattr(original, WRAPPED, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, WRAPPED, True)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)
