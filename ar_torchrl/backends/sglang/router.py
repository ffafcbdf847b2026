"""sglang-router (the SGLang Model Gateway, PyPI ``sglang-router``) in front of SGLang servers.

:func:`launch_sglang_router` starts a router in front of running servers ("workers") and stops it
on exit; like a launched server it never outlives this process (the context manager, the watchdog
of :mod:`~ar_torchrl.backends.sglang.reaper`, a parent-death signal). :func:`router_workers`
reads the workers a router routes to (``GET /workers``): the SGLang backend syncs each of them
itself. It runs in the SGLang server environment (``.venv-sglang``, where
``scripts/setup_sglang_env.sh`` installs the pinned :data:`ROUTER_VERSION`).

What the backend relies on, measured with sglang-router 0.3.2 in front of SGLang 0.5.23 servers:

- **Requests** go through ``POST /generate`` only (the OpenAI-style routes drop more fields). The
  router decodes the body into its own typed request and encodes it again: it adds its defaults
  (``stream``, ``return_text_in_logprobs``, ``log_metrics``, ...: accepted by SGLang), keeps
  ``input_ids``, ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num`` and ``rid``, and
  silently drops the ``sampling_params`` keys in :data:`ROUTER_DROPPED_SAMPLING_KEYS` (the backend
  refuses them up front). A batch with a *list* of ``sampling_params`` is refused with HTTP 422,
  so seeded requests go one sample per request. Answers come back byte for byte.
- **Weights**: the router has no weight-update route (``/update_weights_from_*``,
  ``/begin_weight_update``, ``/pause_generation``: HTTP 404), so every sync goes to each worker
  directly. ``GET /workers`` answers ``{"workers": [{"id", "url", "is_healthy", ...}], "total": N,
  ...}``; ``POST /workers {"url": ...}`` adds one and ``DELETE /workers/<id>`` removes one.
  ``POST /flush_cache`` fans out to every worker (the backend flushes each worker itself).
- **API key**: with ``--api-key K`` the router wants ``Authorization: Bearer K`` on ``/generate`` and
  ``/workers`` and sends the same header to the workers (``/health`` needs none).
- **Health checks** (default: every 60 s, 5 s timeout, a worker is dropped from the rotation after 3
  failures) fight training pauses: a CPU server busy loading weights can miss them. The launcher
  turns them off unless asked (as slime does); then a dead worker keeps its place and the router
  retries a failed request on another worker, while a sync to it fails (and names it).
- **Start and stop**: workers register in the background within a few seconds after the router
  answers; the launcher waits until every one is listed. ``sglang_router.launch_router`` imports
  all of SGLang (torch included: ~40 s on a loaded 2-core machine) for its Python fallback, so the
  launcher starts the Rust router directly (ready in ~2-3 s). SIGTERM stops it in well under a
  second. It serves Prometheus metrics on ``0.0.0.0:29000`` unless told: the launcher binds them to
  the router's host, on a free port.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from ar_torchrl.backends.sglang import reaper
from ar_torchrl.backends.sglang.errors import SGLangLaunchError, SGLangResponseError
from ar_torchrl.backends.sglang.launcher import (
    API_KEY_ENV,
    _server_python,
    _tempfile,
    free_port,
    log_tail,
    prelude,
    spawn_guarded,
    split_secret_args,
)
from ar_torchrl.utils.checks import is_server_url

__all__ = [
    "ROUTER_DROPPED_SAMPLING_KEYS",
    "ROUTER_VERSION",
    "RouterWorker",
    "SGLangRouter",
    "launch_sglang_router",
    "router_workers",
    "stop_router",
]

logger = logging.getLogger(__name__)

#: The sglang-router version ``scripts/setup_sglang_env.sh`` installs (what this module was measured on).
ROUTER_VERSION = "0.3.2"

#: ``sampling_params`` keys SGLang accepts that sglang-router 0.3.2 drops without a word (measured:
#: each key sent alone through the router, then read at the worker).
ROUTER_DROPPED_SAMPLING_KEYS = frozenset(
    "stop_regex structural_tag spaces_between_special_tokens stream_interval logit_bias "
    "custom_params beam_width watermark choice".split()
)

# The Rust router without sglang_router.launch_router (which imports all of SGLang for its Python
# fallback, ~40 s): the same argument parser, then the Rust server (blocks until SIGTERM/SIGINT).
_ROUTER_MAIN = prelude(
    """
import argparse
import setproctitle
from sglang_router.router import Router
from sglang_router.router_args import RouterArgs

setproctitle.setproctitle("sglang::router")
parser = argparse.ArgumentParser(prog="sglang-router")
RouterArgs.add_cli_args(parser, use_router_prefix=False)
router_args = RouterArgs.from_cli_args(parser.parse_args(sys.argv[1:]), use_router_prefix=False)
router_args._validate_router_args()
Router.from_args(router_args).start()
"""
)


@dataclass(frozen=True)
class RouterWorker:
    """One worker a router routes to, as ``GET /workers`` lists it (see :func:`router_workers`).

    Example:
        >>> RouterWorker("http://127.0.0.1:30001", "7c7e81b7", healthy=True).url
        'http://127.0.0.1:30001'
    """

    url: str
    id: str
    healthy: bool


def router_workers(answer: Any, router_url: str) -> list[RouterWorker]:
    """The workers in a router's ``GET /workers`` answer, checked field by field.

    Raises:
        SGLangResponseError: the answer is not the router's shape, lists no worker, lists one
            twice, or a worker the backend cannot sync over HTTP (e.g. a ``grpc://`` worker).

    Example:
        >>> answer = {"workers": [{"id": "7c", "url": "http://127.0.0.1:30001", "is_healthy": True}],
        ...           "total": 1}
        >>> router_workers(answer, "http://127.0.0.1:30000")
        [RouterWorker(url='http://127.0.0.1:30001', id='7c', healthy=True)]
        >>> router_workers({"workers": [], "total": 0}, "http://127.0.0.1:30000")
        Traceback (most recent call last):
        ...
        ar_torchrl.backends.sglang.errors.SGLangResponseError: sglang-router http://127.0.0.1:30000/workers lists no worker: add the servers to it (POST /workers {"url": ...}) or check its log
    """
    where = f"sglang-router {router_url}/workers"
    items = answer.get("workers") if isinstance(answer, dict) else None
    if not isinstance(items, list):
        raise SGLangResponseError(
            f"{where}: expected {{'workers': [...]}}, got {str(answer)[:300]!r}; is {router_url} "
            "an sglang-router (0.3.x)? A single SGLang server goes in backend.url"
        )
    workers = []
    for k, item in enumerate(items):
        url = item.get("url") if isinstance(item, dict) else None
        if not isinstance(url, str):
            raise SGLangResponseError(f"{where}: workers[{k}] has no 'url': {str(item)[:300]!r}")
        if not is_server_url(url):
            raise SGLangResponseError(
                f"{where}: worker {url!r} is not an http(s)://host:port server; weight syncs go to "
                "each worker over HTTP (gRPC and dp-aware workers are not supported)"
            )
        workers.append(
            RouterWorker(url.rstrip("/"), str(item.get("id", "")), item.get("is_healthy") is True)
        )
    if not workers:
        raise SGLangResponseError(
            f'{where} lists no worker: add the servers to it (POST /workers {{"url": ...}}) or '
            "check its log"
        )
    urls = [w.url for w in workers]
    if len(set(urls)) != len(urls):
        raise SGLangResponseError(f"{where}: a worker is listed twice in {urls}")
    return workers


@dataclass
class SGLangRouter:
    """A router started by :func:`launch_sglang_router` (``api_key`` is left out of its repr).

    Example:
        >>> SGLangRouter("http://127.0.0.1:30000", None, Path("r.log"), 30000, ["http://w:1"], "k")
        SGLangRouter(url='http://127.0.0.1:30000', process=None, log_path=PosixPath('r.log'), port=30000, worker_urls=['http://w:1'], metrics_port=None)
    """

    url: str
    process: subprocess.Popen | None
    log_path: Path
    port: int
    worker_urls: list[str]
    api_key: str | None = field(default=None, repr=False)
    metrics_port: int | None = None


def stop_router(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the router, SIGKILL its process group after ``grace_s``; forget it in the reaper."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            logger.warning(
                "sglang-router pid %d ignored SIGTERM for %gs: SIGKILL", process.pid, grace_s
            )
            process.kill()
            process.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # its own session: nothing else is in it
    reaper.release_process_group(process.pid)


def _listed(router: SGLangRouter) -> list[str] | None:
    """The worker URLs the router lists now (``None`` while it does not answer)."""
    headers = {"Authorization": f"Bearer {router.api_key}"} if router.api_key else {}
    try:
        answer = requests.get(router.url + "/workers", headers=headers, timeout=5)
        if answer.status_code != 200:
            return None
        return [w.get("url", "").rstrip("/") for w in answer.json().get("workers", [])]
    except (requests.exceptions.RequestException, ValueError, AttributeError):
        return None


def _wait_ready(router: SGLangRouter, timeout_s: float) -> None:
    deadline, listed = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            raise SGLangLaunchError(
                f"sglang-router exited with code {router.process.returncode} before listing its "
                f"workers; log {router.log_path}:\n{log_tail(router.log_path)}"
            )
        listed = _listed(router)
        if listed is not None and set(router.worker_urls) <= set(listed):
            return
        time.sleep(0.2)
    missing = sorted(set(router.worker_urls) - set(listed or ()))
    raise SGLangLaunchError(
        f"sglang-router at {router.url} did not list the workers {missing} within {timeout_s}s "
        f"(it lists {listed}); are they healthy SGLang servers? Log {router.log_path}:\n"
        f"{log_tail(router.log_path)}"
    )


@contextlib.contextmanager
def launch_sglang_router(
    worker_urls: Sequence[str],
    *,
    python: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    api_key: str | None = None,
    health_checks: bool = False,
    request_timeout_s: float = 1800.0,
    extra_args: Sequence[str] = (),
    log_file: str | Path | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[SGLangRouter]:
    """Start an sglang-router in front of ``worker_urls`` and stop it on exit.

    The router runs ``--policy cache_aware`` (its default), logs warnings only (``--log-level
    warn``: at ``info`` it writes two lines per request) and serves its metrics on ``host`` (a free
    port). It is ready once it lists every worker (``GET /workers``).

    Args:
        worker_urls: the running SGLang servers (``http://host:port``).
        python: interpreter of the SGLang environment, where sglang-router is installed (default
            ``.venv-sglang/bin/python``).
        host, port: where the router listens (default port: a free one).
        api_key: the servers' ``--api-key`` (default ``$AR_TORCHRL_SGLANG_API_KEY``, if set): the
            router then wants it from its clients and sends it to the servers. Passed through a
            pipe, never on the command line.
        health_checks: keep the router's periodic worker health checks (off: see the module
            docstring).
        request_timeout_s: the router's own deadline of one request (``--request-timeout-secs``;
            keep it above the client's ``timeout_s``).
        extra_args: more ``sglang_router.launch_router`` flags (later flags win, e.g.
            ``["--policy", "round_robin"]``).
        log_file: where the router writes (default: a temp file).
        timeout_s: how long to wait until it lists every worker.
        env: extra environment variables.

    Raises:
        FileNotFoundError: no SGLang environment (run ``bash scripts/setup_sglang_env.sh``).
        SGLangLaunchError: the router exited or did not list the workers; the message has the
            log's tail.

    Example:
        >>> with launch_sglang_router(["http://127.0.0.1:9"], python="/nonexistent/python"):
        ...     pass
        Traceback (most recent call last):
        ...
        FileNotFoundError: SGLang server python /nonexistent/python not found. Run `bash scripts/setup_sglang_env.sh` ...
    """
    urls = [str(u).rstrip("/") for u in worker_urls]
    if not urls:
        raise ValueError("launch_sglang_router: worker_urls is empty; pass the servers' URLs")
    python = _server_python(python)
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    log_path = Path(log_file) if log_file else Path(_tempfile("sglang-router-", ".log"))
    public, secret = split_secret_args(extra_args)
    secret += ["--api-key", api_key] if api_key else []
    port = port or free_port(host)
    metrics_port = free_port(host)
    args = ["--host", host, "--port", str(port), "--worker-urls", *urls]
    args += ["--prometheus-host", host, "--prometheus-port", str(metrics_port)]
    args += ["--log-level", "warn", "--shutdown-grace-period-secs", "5"]
    args += ["--request-timeout-secs", str(max(1, math.ceil(request_timeout_s)))]
    args += [] if health_checks else ["--disable-health-check"]
    args += list(public)
    run_env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    run_env.update(env or {})
    logger.info(
        "launching sglang-router: %s %s%s (log %s)",
        python,
        " ".join(args),
        f" + {' '.join(secret[::2])} through a pipe" if secret else "",
        log_path,
    )
    process = spawn_guarded(python, args, secret, log_path, run_env, main=_ROUTER_MAIN)
    router = SGLangRouter(
        url=f"http://{host}:{port}",
        process=process,
        log_path=log_path,
        port=port,
        worker_urls=urls,
        api_key=api_key,
        metrics_port=metrics_port,
    )
    try:
        start = time.monotonic()
        _wait_ready(router, timeout_s)
        logger.info(
            "sglang-router ready at %s (pid %d) in %.1f s, in front of %s",
            router.url,
            process.pid,
            time.monotonic() - start,
            urls,
        )
        yield router
    finally:
        stop_router(process)
