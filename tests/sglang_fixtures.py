"""Shared pytest fixtures for the SGLang tests: ONE real server per session, and the fast double.

Import the fixtures explicitly in a test module::

    from sglang_fixtures import sglang_double, sglang_model_dir, sglang_server  # noqa: F401

The real server (SGLang 0.5.23 on CPU, tiny Qwen3 from ``save_tiny_model(seed=0)``) is started
through the library launcher on first use and shared by every module (a module-level cache, so that
importing the fixture into several modules still starts one server); it stops at session end. A
missing server venv FAILS the test (it does not skip) and says how to create it.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
from sglang_double import serve_double

from ar_torchrl.assets import save_tiny_model
from ar_torchrl.backends._sglang_protocol import default_sglang_venv
from ar_torchrl.backends.sglang import launch_sglang_server

logger = logging.getLogger(__name__)

TINY_SEED = 0
_STATE: dict = {}


def require_sglang_venv():
    """The server venv's python, or ``pytest.fail`` with the command that creates it."""
    python = default_sglang_venv() / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"SGLang server venv not found ({python}). Run `bash scripts/setup_sglang_env.sh` "
            "(or set AR_TORCHRL_SGLANG_VENV) before the SGLang tests.",
            pytrace=False,
        )
    return python


@pytest.fixture(scope="session")
def sglang_model_dir(tmp_path_factory):
    """A tiny Qwen3 HF dir (``save_tiny_model(seed=0)``): char tokenizer, vocab 99, eos 2."""
    if "model_dir" not in _STATE:
        _STATE["model_dir"] = save_tiny_model(
            tmp_path_factory.mktemp("sglang") / "model", seed=TINY_SEED
        )
    return _STATE["model_dir"]


@pytest.fixture(scope="session")
def sglang_server(sglang_model_dir, tmp_path_factory):
    """The session's real SGLang server (``.url``, ``.process``, ``.log_path``)."""
    python = require_sglang_venv()
    if "server" not in _STATE:
        stack = contextlib.ExitStack()
        log = tmp_path_factory.mktemp("sglang-log") / "server.log"
        _STATE["server"] = stack.enter_context(
            launch_sglang_server(sglang_model_dir, python=python, log_file=log, timeout_s=300)
        )
        _STATE["stack"] = stack
    yield _STATE["server"]
    stack = _STATE.pop("stack", None)
    if stack is not None:
        _STATE.pop("server", None)
        stack.close()


@pytest.fixture
def sglang_double():
    """A fresh in-process protocol double (see ``tests/sglang_double.py``)."""
    double, stop = serve_double()
    yield double
    stop()


def trainer_log_probs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0):
    """The trainer's fp32 ``log_softmax(logits / T)`` of ``tokens`` after ``prompt``: ``[len(tokens)]``."""
    import torch

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(
        -1, torch.tensor(tokens)[:, None]
    )[:, 0]
