"""Lazy package exports (PEP 562), shared by the packages whose ``__init__`` must stay cheap.

A package lists ``name -> submodule`` and gets a module ``__getattr__`` / ``__dir__`` pair: a
name is imported from its submodule on first access and cached in the package's namespace. This is
what lets the recipe's config layer import ``ar_torchrl.objectives.registry`` or
``ar_torchrl.data.tasks`` without importing torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

from ar_torchrl import _compat

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, importing ``exports[name]`` (a submodule name
    relative to ``package``, or an absolute ``ar_torchrl.…`` module path) when ``name`` is first
    read.

    Example:
        >>> getattr_, dir_ = lazy_exports("ar_torchrl.utils", {"check_number": "checks"})
        >>> getattr_("check_number").__name__
        'check_number'
        >>> getattr_("nope")
        Traceback (most recent call last):
        ...
        AttributeError: module 'ar_torchrl.utils' has no attribute 'nope'
    """

    def __getattr__(name: str) -> object:
        if name not in exports:  # an old name kept for one release, or AttributeError
            return _compat.renamed(package, name)
        module = exports[name]
        module = module if module.startswith("ar_torchrl.") else f"{package}.{module}"
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
