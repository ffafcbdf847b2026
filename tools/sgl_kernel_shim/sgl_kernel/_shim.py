"""Shared machinery of the ``sgl_kernel`` import shim (see ``sgl_kernel/__init__.py``)."""

from __future__ import annotations

from typing import Any


class MissingKernelOp:
    """Stand-in for one ``sgl_kernel`` attribute: raises ``NotImplementedError`` when called.

    Attribute access returns a nested stand-in, so ``sgl_kernel.foo.bar`` resolves too; only a call
    fails, naming the op that a code path tried to use on this CPU server.

    >>> op = MissingKernelOp("sgl_kernel.rmsnorm")
    >>> op(1)
    Traceback (most recent call last):
    ...
    NotImplementedError: sgl_kernel.rmsnorm was called, but sgl_kernel here is the CPU import shim ...
    """

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{self._qualname} was called, but sgl_kernel here is the CPU import shim "
            "(tools/sgl_kernel_shim) which has no kernels. Use a code path that does not need it "
            "(--attention-backend torch_native, a dense model) or install a real sgl_kernel build."
        )

    def __getattr__(self, name: str) -> MissingKernelOp:
        if name.startswith("__"):
            raise AttributeError(name)
        return MissingKernelOp(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel shim op {self._qualname}>"


def module_getattr(module_name: str):
    """Build a module-level ``__getattr__`` that returns :class:`MissingKernelOp` stand-ins.

    Dunder names raise ``AttributeError`` so the import machinery and ``hasattr`` probes of module
    metadata behave normally.

    >>> getattr_ = module_getattr("sgl_kernel")
    >>> getattr_("silu_and_mul")
    <sgl_kernel shim op sgl_kernel.silu_and_mul>
    """

    def __getattr__(name: str) -> MissingKernelOp:
        if name.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return MissingKernelOp(f"{module_name}.{name}")

    return __getattr__
