"""CPU import shim for ``sgl_kernel`` (SGLang's CUDA kernel library).

``sgl_kernel`` has no CPU build on PyPI and its CUDA build fails to import without ``libcuda.so.1``.
On the ``--attention-backend torch_native`` path with a dense Qwen3/Llama model SGLang never calls a
kernel from it, but it imports the package. This shim makes the import succeed; every attribute is a
stand-in that raises ``NotImplementedError`` naming the op when called, so any code path that really
needed a kernel fails loudly. It is put on ``PYTHONPATH`` of the server process only (see
``ar_torchrl.backends.sglang.launch_sglang_server``); never install it into a GPU environment.
"""

from __future__ import annotations

from sgl_kernel._shim import MissingKernelOp, module_getattr

__version__ = "0.0.0+cpu-shim"
__all__ = ["MissingKernelOp"]
__getattr__ = module_getattr(__name__)
