"""CPU import shim for ``sgl_kernel.mamba``: every attribute raises ``NotImplementedError`` when called."""

from __future__ import annotations

from sgl_kernel._shim import module_getattr

__getattr__ = module_getattr(__name__)
