"""Shared fixtures.

SGLang (marker ``sglang``): ONE real server for the whole session (``sglang_server``, started by
the library launcher on first use, with an API key that every client of the session sends), a second
real server started by a separate stand-in trainer process when a test needs two servers or a
server whose parent it kills (``second_server``), and the in-process protocol double
(``sglang_double``, checked against SGLang's own schema). A missing server venv FAILS the real-server
tests and says how to create it; in the fast tier (``AR_TORCHRL_TESTS=fast``, see scripts/test.sh)
they are deselected, and the double's tests skip when the schema is absent.
"""

from __future__ import annotations

import contextlib
import os

import pytest
from support.sglang_double import serve_double
from support.sglang_helpers import ParentServer, require_schema, require_sglang_venv
from support.xdist_groups import tag_group

from ar_torchrl.backends.sglang.launcher import API_KEY_ENV, launch_sglang_server
from ar_torchrl.models.tiny import save_tiny_model

TINY_SEED = 0
TEST_API_KEY = "ar-torchrl-test-key"


#: Session fixtures that run the recipe: every test using one goes to one pytest-xdist worker.
SHARED_RUNS = {"separate_run": "tool-runs", "confidence_run": "tool-runs", "straight": "straight"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """The doctests of ``backends/sglang/schema.py`` read SGLang's schema from .venv-sglang: mark
    them ``sglang`` so that the fast tier (``-m "not sglang"``) deselects them with the rest.

    Under pytest-xdist (scripts/test.sh runs 2 workers with ``--dist loadgroup``), tests that share
    an expensive fixture run on one worker, so that it is built once: the real SGLang server (every
    ``sglang`` test), the recipe runs of :data:`SHARED_RUNS`, and a module's module-scoped fixtures
    (a Ray cluster, a module's recipe run). Other tests go to whichever worker is free.
    """
    for item in items:
        if (
            "ar_torchrl.backends.sglang.schema." in item.nodeid
            and "default_sglang_venv" not in item.nodeid
        ):
            item.add_marker(pytest.mark.sglang)
        group = _worker_group(item)
        if group is not None:
            tag_group(item, group)


def _worker_group(item) -> str | None:
    if item.get_closest_marker("sglang") is not None:
        return "sglang"
    fixtures = getattr(item, "fixturenames", ())
    for name in fixtures:
        if name in SHARED_RUNS:
            return SHARED_RUNS[name]
    info = getattr(item, "_fixtureinfo", None)
    for name in fixtures:
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if defs and defs[-1].scope == "module":
            return item.nodeid.split("::")[0]
    return None


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """The recipe tests' ``AR_TORCHRL_CACHE``: each warm start is computed once per session, also
    under pytest-xdist (the workers share one directory; the library's cache lock makes one of them
    train an entry while the others wait for it)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return tmp_path_factory.mktemp("ar_torchrl_cache")
    shared = tmp_path_factory.getbasetemp().parent / "ar_torchrl_cache"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def separate_run(tmp_path_factory, cache_dir):
    """One process of the recipe with ``critic=separate`` on the tool task
    (tests/recipes/test_recipe_critic.py's ``SEPARATE``): ``(run directory, history)``; the torchrun test
    compares 2 ranks with it."""
    from support.recipe_runs import SEPARATE, TOOL_CONFIG, run_recipe

    run_dir = tmp_path_factory.mktemp("separate")
    return run_dir, run_recipe(run_dir, cache_dir, *SEPARATE, config_name=TOOL_CONFIG)[1]


@pytest.fixture(scope="session")
def confidence_run(tmp_path_factory, cache_dir):
    """One process of the recipe as :func:`separate_run` plus ``support.recipe_runs.CONFIDENCE``:
    ``(run directory, history)``; tests/recipes/test_recipe_critic.py reads it, the torchrun test
    compares 2 ranks with it."""
    from support.recipe_runs import CONFIDENCE, SEPARATE, TOOL_CONFIG, run_recipe

    run_dir = tmp_path_factory.mktemp("confidence")
    _, history = run_recipe(run_dir, cache_dir, *SEPARATE, *CONFIDENCE, config_name=TOOL_CONFIG)
    return run_dir, history


@pytest.fixture(scope="session")
def sglang_model_dir(tmp_path_factory):
    """A tiny Qwen3 HF dir (``save_tiny_model(seed=0)``): char tokenizer, vocab 99, eos 2."""
    return save_tiny_model(tmp_path_factory.mktemp("sglang") / "model", seed=TINY_SEED)


@pytest.fixture(scope="session")
def sglang_api_key():
    """The session's SGLang API key, exported so that clients and launched servers use it."""
    old = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = TEST_API_KEY
    yield TEST_API_KEY
    if old is None:
        os.environ.pop(API_KEY_ENV, None)
    else:
        os.environ[API_KEY_ENV] = old


@pytest.fixture(scope="session")
def sglang_server(sglang_model_dir, sglang_api_key, tmp_path_factory):
    """The session's real SGLang server (``.url``, ``.process``, ``.log_path``, ``.api_key``)."""
    python = require_sglang_venv()
    log = tmp_path_factory.mktemp("sglang-log") / "server.log"
    with launch_sglang_server(
        sglang_model_dir, python=python, log_file=log, timeout_s=300
    ) as server:
        yield server


class _SecondServer:
    """Starts (and, once killed, restarts) the second real server on demand."""

    def __init__(self, model_dir, log_dir) -> None:
        self.model_dir, self.log_dir, self.current, self.started = model_dir, log_dir, None, 0

    def get(self) -> ParentServer:
        if self.current is None or not self.current.alive():
            self.started += 1
            log = self.log_dir / f"second-{self.started}.log"
            self.current = ParentServer(self.model_dir, log, sync=True)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()


@pytest.fixture(scope="session")
def second_server(sglang_model_dir, sglang_api_key, tmp_path_factory):
    """A second real server, launched by a stand-in trainer process (``.get()`` starts it)."""
    require_sglang_venv()
    holder = _SecondServer(sglang_model_dir, tmp_path_factory.mktemp("sglang-second"))
    yield holder
    with contextlib.suppress(Exception):
        holder.close()


@pytest.fixture
def sglang_double():
    """A fresh in-process protocol double (see ``tests/support/sglang_double.py``)."""
    require_schema()
    double, stop = serve_double()
    yield double
    stop()
