"""The checks against the imported vLLM: each hook resolved and its leading
parameters compared, each attribute looked up on its class (fields,
properties, ``self.x`` assignments in its methods and its bases'). At
start-up, modules not imported yet are read from source instead.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from vllm_kv_cache_limit.compat import attributes as listed
from vllm_kv_cache_limit.compat import registry
from vllm_kv_cache_limit.compat.entries import Attribute, Hook, for_version, missing_message
from vllm_kv_cache_limit.compat.source_check import _set_on, check_attributes_in_source, check_hooks_in_source
from vllm_kv_cache_limit.compat.versions import installed_vllm_version


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
    hooks = for_version(registry.cap_hooks() if hooks is None else hooks, installed_vllm_version())
    return [problem for hook in hooks if (problem := resolve_hook(hook)[1])]


def check_hooks_at_startup(
    hooks: tuple[Hook, ...] | None = None, attributes: tuple[Attribute, ...] | None = None
) -> list[str]:
    """Problems with the hooks (default: ``HOOKS``) and the attributes
    (default: ``ATTRIBUTES``), cheaply enough for every start-up with a cap:
    those in modules the process has already imported are checked on the
    live objects, the others (the worker modules, which the first process
    never needs) in vLLM's source with ``ast``, without importing them."""
    hooks = for_version(registry.cap_hooks() if hooks is None else hooks, installed_vllm_version())
    loaded = tuple(h for h in hooks if any(m in sys.modules for m in h.modules))
    problems = check_hooks(loaded)
    rest = tuple(h for h in hooks if h not in loaded)
    if rest:
        root = _installed_root()
        if root is None:
            problems += [f"{h.name} is missing" for h in rest]
        else:
            problems += check_hooks_in_source(root, rest)
    return problems + check_attributes_at_startup(attributes)


def _installed_root() -> Path | None:
    """The folder that holds the installed ``vllm/`` package, found without importing it."""
    vllm_spec = importlib.util.find_spec("vllm")
    if vllm_spec is None or not vllm_spec.submodule_search_locations:
        return None
    return Path(next(iter(vllm_spec.submodule_search_locations))).parent


def check_attributes(attributes: tuple[Attribute, ...] | None = None) -> list[str]:
    """Problems with the attributes (default: ``ATTRIBUTES``) that the
    installed vLLM should have, on the imported classes (their modules are
    imported); empty when all fit."""
    attributes = for_version(listed.ATTRIBUTES if attributes is None else attributes, installed_vllm_version())
    return [problem for attribute in attributes if (problem := _live_attribute_problem(attribute))]


def check_attributes_at_startup(attributes: tuple[Attribute, ...] | None = None) -> list[str]:
    """As :func:`check_attributes`, cheaply enough for a start-up (or the
    first resize): attributes of modules already imported (and those of
    Python's standard library) on the live classes, the others in vLLM's
    source with ``ast``, without importing their modules."""
    attributes = for_version(listed.ATTRIBUTES if attributes is None else attributes, installed_vllm_version())
    live = tuple(a for a in attributes if a.not_in_source or any(m in sys.modules for m in a.modules))
    problems = check_attributes(live)
    rest = tuple(a for a in attributes if a not in live)
    if rest:
        root = _installed_root()
        problems += [missing_message(a) for a in rest] if root is None else check_attributes_in_source(root, rest)
    return problems


def _live_attribute_problem(attribute: Attribute) -> str | None:
    for module_name in attribute.modules:
        try:
            owner: object = importlib.import_module(module_name)
        except ImportError:
            continue
        if not attribute.owner:
            return None if hasattr(owner, attribute.attr) else missing_message(attribute, module_name)
        for part in attribute.owner.split("."):
            owner = getattr(owner, part, None)
        if isinstance(owner, type):
            found = class_has_attribute(owner, attribute.attr)
            if not found and attribute.not_in_source:
                found = _instance_has(owner, attribute.attr)
            return None if found else missing_message(attribute, module_name)
    return missing_message(attribute)


def class_has_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have attribute ``name``: a class
    attribute, method or property, a dataclass field, a ``__slots__`` entry
    or an annotation of ``cls`` or a base, or set on ``self`` in a method
    defined in ``cls`` or in a base from the same top-level package
    (``self.name = ...``, read from the method's source with ``ast``,
    ``__init__`` first)."""
    import dataclasses

    if dataclasses.is_dataclass(cls) and any(f.name == name for f in dataclasses.fields(cls)):
        return True
    for klass in cls.__mro__:
        namespace = vars(klass)
        slots = namespace.get("__slots__", ())
        if name in namespace or name in namespace.get("__annotations__", {}):
            return True
        if name in ((slots,) if isinstance(slots, str) else slots):
            return True
    package = cls.__module__.partition(".")[0]
    methods = [
        function
        for klass in cls.__mro__
        if klass.__module__.partition(".")[0] == package
        for function in _methods(klass)
    ]
    methods.sort(key=lambda function: function.__name__ not in ("__init__", "__post_init__"))
    return any(name in _set_in_method(function) for function in methods)


def _methods(klass: type) -> list[Any]:
    """The functions defined in ``klass``'s own body (a wrapper the plugin
    put there counts as the function it wraps)."""
    found = []
    for value in vars(klass).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        values = [value.fget, value.fset] if isinstance(value, property) else [value]
        for function in values:
            function = inspect.unwrap(function) if callable(function) else function
            if inspect.isfunction(function) and function.__qualname__.startswith(f"{klass.__qualname__}."):
                found.append(function)
    return found


def _set_in_method(function: Any) -> set[str]:
    """The attribute names ``function`` sets on its first argument, read from its source."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return set()
    # A method's source is indented; nest it rather than dedent it (a string
    # in its body may have lines at column 0).
    indented = source[:1] in (" ", "\t")
    try:
        tree = ast.parse(f"if 1:\n{source}" if indented else source)
    except SyntaxError:
        return set()
    body = tree.body[0].body if indented and isinstance(tree.body[0], ast.If) else tree.body
    node = body[0] if body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    params = [*node.args.posonlyargs, *node.args.args]
    return _set_on(node, params[0].arg) if params else set()


def _instance_has(cls: type, name: str) -> bool:
    """For a class of Python's standard library: whether an instance built
    without arguments has ``name`` (an ``ArgumentParser`` sets its
    ``_actions`` in ``__init__``)."""
    try:
        return hasattr(cls(), name)
    except Exception:
        return False
