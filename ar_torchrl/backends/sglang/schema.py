"""SGLang's own ``/generate`` schema, loaded by file path, and validation helpers.

SGLang 0.5.x validates every ``/generate`` body with the generated msgspec module
``sglang/api/v1/api_types.py`` (``GenerateRequest``, ``GenerateResponse``, ...). That file imports only
``msgspec``, so it can be loaded by path with :func:`importlib.util.spec_from_file_location` without
importing ``sglang`` (which would pull torch 2.14 and triton into the library's environment). The
light test double (``tests/support/sglang_double.py``) uses these helpers to stay exactly on protocol.

Where the file is looked up, first hit wins:

1. ``$AR_TORCHRL_SGLANG_API_TYPES``: a path to ``api_types.py``;
2. the site-packages of ``$AR_TORCHRL_SGLANG_VENV``, else of ``.venv-sglang`` in the repository root
   (created by ``bash scripts/setup_sglang_env.sh``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "SchemaNotFoundError",
    "find_api_types",
    "load_api_types",
    "validate_generate_request",
    "validate_generate_response",
]

API_TYPES_ENV = "AR_TORCHRL_SGLANG_API_TYPES"
VENV_ENV = "AR_TORCHRL_SGLANG_VENV"
_RELATIVE = Path("sglang") / "api" / "v1" / "api_types.py"
_MODULE_NAME = "_ar_torchrl_sglang_api_types"


class SchemaNotFoundError(FileNotFoundError):
    """SGLang's ``api_types.py`` could not be found (the SGLang venv is missing)."""


def default_sglang_venv() -> Path:
    """The SGLang server venv: ``$AR_TORCHRL_SGLANG_VENV`` or ``<repo>/.venv-sglang``.

    Example:
        >>> default_sglang_venv().name in {".venv-sglang"} or "AR_TORCHRL_SGLANG_VENV" in os.environ
        True
    """
    env = os.environ.get(VENV_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / ".venv-sglang"


def find_api_types() -> Path:
    """Locate SGLang's ``api_types.py``; raise :class:`SchemaNotFoundError` with the fix if absent.

    Example:
        >>> find_api_types().name
        'api_types.py'
    """
    env = os.environ.get(API_TYPES_ENV)
    if env:
        if not Path(env).is_file():
            raise SchemaNotFoundError(f"${API_TYPES_ENV}={env!r} is not a file")
        return Path(env)
    venv = default_sglang_venv()
    hits = sorted(venv.glob(f"lib/python3*/site-packages/{_RELATIVE.as_posix()}"))
    if not hits:
        raise SchemaNotFoundError(
            f"SGLang's msgspec schema {_RELATIVE} was not found under {venv}. Run "
            f"`bash scripts/setup_sglang_env.sh` to create the SGLang venv, or point "
            f"${API_TYPES_ENV} at an api_types.py from the sglang wheel."
        )
    return hits[-1]


@functools.lru_cache(maxsize=1)
def load_api_types() -> ModuleType:
    """Import SGLang's ``api_types`` module by file path (only ``msgspec`` is needed).

    Example:
        >>> api = load_api_types()
        >>> api.GenerateRequest.from_json_value({"input_ids": [1, 2]}).input_ids
        [1, 2]
    """
    path = find_api_types()
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module  # msgspec resolves forward references through sys.modules
    spec.loader.exec_module(module)
    return module


def validate_generate_request(body: Any) -> Any:
    """Decode a parsed ``/generate`` JSON body as SGLang does; return its ``GenerateRequest``.

    Raises:
        ValueError: SGLang's own ``JsonContractError`` (the server answers it with HTTP 400 and
            ``{"error": str(exc)}``), e.g. for an unknown ``sampling_params`` key.

    Example:
        >>> validate_generate_request({"input_ids": [1], "sampling_params": {"max_tokens": 4}})
        Traceback (most recent call last):
        ...
        _ar_torchrl_sglang_api_types.JsonContractError: unknown field `max_tokens`, expected one of ...
    """
    return load_api_types().GenerateRequest.from_json_value(body)


def validate_generate_response(body: Any) -> list[Any]:
    """Decode a ``/generate`` response (one object, or a list for ``n > 1`` / batches).

    Returns:
        The list of decoded ``GenerateResponse`` items.

    Example:
        >>> item = {"text": "", "output_ids": [5], "meta_info": {"id": "a", "prompt_tokens": 1,
        ...     "completion_tokens": 1, "finish_reason": {"type": "length", "length": 1},
        ...     "output_token_logprobs": [[-0.5, 5, None]], "weight_version": "default"}}
        >>> validate_generate_response(item)[0].meta_info.output_token_logprobs[0].logprob
        -0.5
    """
    api = load_api_types()
    items = body if isinstance(body, list) else [body]
    return [api.GenerateResponse.from_json_value(item) for item in items]
