"""TorchRL's ``AsyncSGLang`` against the session's real SGLang server, which requires an API key.

TorchRL 0.14.1's ``AsyncSGLang`` sends no ``Authorization`` header (bare ``requests.get`` /
``requests.post``), and the tests' server is started with ``--api-key`` (tests/conftest.py). Rather
than a second server without a key, :func:`authorized` gives TorchRL's SGLang modules a ``requests``
whose calls to that server carry ``Authorization: Bearer <key>`` (what an authenticating proxy in
front of the server would add); every other call, and everything else of ``requests``, is unchanged.
"""

from __future__ import annotations

import types

import requests


def _with_key(fn, url: str, api_key: str):
    def call(target, *args, **kwargs):
        if str(target).startswith(url):
            headers = dict(kwargs.pop("headers", None) or {})
            headers.setdefault("Authorization", f"Bearer {api_key}")
            kwargs["headers"] = headers
        return fn(target, *args, **kwargs)

    return call


def authorized(monkeypatch, url: str, api_key: str) -> None:
    """Patch TorchRL's SGLang client modules (undone by ``monkeypatch`` at teardown)."""
    from torchrl.modules.llm.backends.sglang import sglang_server, sglang_utils

    shim = types.SimpleNamespace(**{k: getattr(requests, k) for k in dir(requests) if k[0] != "_"})
    shim.get = _with_key(requests.get, url, api_key)
    shim.post = _with_key(requests.post, url, api_key)
    for module in (sglang_server, sglang_utils):
        monkeypatch.setattr(module, "requests", shim)
