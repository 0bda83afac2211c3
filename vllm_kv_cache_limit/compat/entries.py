"""What the checks check: a vLLM function the plugin wraps or calls
(:class:`Hook`) and an attribute it relies on (:class:`Attribute`), each
with the vLLM releases that have it. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar


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
    wrapper: Callable[..., Any] | None = None
    """The plugin function that wraps it, declared beside this entry in the
    module of ``hooks.cap`` or ``hooks.runtime`` named after the vLLM module it
    patches; None: only called."""
    upstream: str = ""
    """The vLLM change that would retire the wrapper, or "none yet" and why."""
    remove_when: str = ""
    """When the wrapper can go."""

    def applies(self, version: str | None) -> bool:
        """Whether vLLM ``version`` (None: any) should have this hook."""
        return _applies(self.versions, version)

    @property
    def name(self) -> str:
        return f"{self.modules[0]}.{self.qualname}"

    @property
    def wrapper_name(self) -> str:
        """Where the wrapper is, as ``hooks.cap.module.function``; empty: none."""
        if self.wrapper is None:
            return ""
        return f"{self.wrapper.__module__.removeprefix('vllm_kv_cache_limit.')}.{self.wrapper.__name__}"


@dataclass(frozen=True)
class Attribute:
    """One attribute of a vLLM object (or a private one of Python's standard
    library) that the plugin reads or writes, as opposed to a function it
    wraps or calls (``Hook``). A rename would otherwise surface as an
    ``AttributeError`` deep inside an engine, or, where it is read with a
    default, not at all."""

    modules: tuple[str, ...]
    """Candidate modules of ``owner``, newest layout first; the first defining it counts."""
    owner: str
    """The class (qualname) whose instances carry it; empty: a module attribute."""
    attr: str
    """The attribute's name."""
    why: str
    """Where the plugin relies on it, and what a rename would break."""
    versions: str = ""
    """PEP 440 specifier of the vLLM releases that have it; empty: all."""
    not_in_source: str = ""
    """Why a vLLM source tree cannot show it; set: the source check skips it
    (and says so) and only the running interpreter's check covers it."""

    def applies(self, version: str | None) -> bool:
        """Whether vLLM ``version`` (None: any) should have this attribute."""
        return _applies(self.versions, version)

    @property
    def qualname(self) -> str:
        return f"{self.owner}.{self.attr}" if self.owner else self.attr

    @property
    def name(self) -> str:
        return f"{self.modules[0]}.{self.qualname}"


def _applies(versions: str, version: str | None) -> bool:
    if not versions or version is None:
        return True
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(Version(version).public) in SpecifierSet(versions)
    except InvalidVersion:
        return True


_Entry = TypeVar("_Entry", Hook, Attribute)


def for_version(hooks: tuple[_Entry, ...], version: str | None) -> tuple[_Entry, ...]:
    """The hooks (or attributes) that vLLM ``version`` should have."""
    return tuple(h for h in hooks if h.applies(version))


def missing_message(attribute: Attribute, module_name: str | None = None) -> str:
    """How the checks name a missing attribute (in ``module_name``, when known)."""
    if module_name is not None:
        return f"{module_name}.{attribute.qualname} is missing"
    where = " or ".join(attribute.modules)
    if not attribute.owner:
        return f"{attribute.name} is missing (no module {where})"
    return f"{attribute.name} is missing (no class {attribute.owner} in {where})"
