"""SGLang rollout backend: an HTTP client for SGLang 0.5.x servers, and a server launcher.

The client speaks HTTP only (``requests``); nothing from ``sglang`` (which pins its own torch) is
imported here. The server runs in its own environment (``.venv-sglang``, made by
``bash scripts/setup_sglang_env.sh``) and is started by :func:`launch_sglang_server` or by hand.

Protocol (SGLang 0.5.23, ``srt/entrypoints/http_server.py`` and ``sglang/api/v1/api_types.py``):

- ``POST /generate`` with ``input_ids``, ``sampling_params`` (SGLang's keys only: an unknown key is a
  400) and ``return_logprob: true``. ``n > 1`` (or a batch) answers a list. Each item has
  ``output_ids`` and ``meta_info`` with ``output_token_logprobs`` (``[[logprob, token_id, text],
  ...]``), ``finish_reason`` (``{"type": "stop" | "length" | "abort", ...}``), ``completion_tokens``
  and ``weight_version``.
- Log-probs: SGLang turns ``temperature = 0`` into ``top_k = 1`` at ``T = 1``, so greedy log-probs
  are those of the ``T = 1`` distribution; sampled ones are ``log softmax(logits / T)``, taken
  *before* top-k / top-p truncation (``srt/layers/sampler.py``).
- ``sampling_seed`` is honoured by SGLang only when the server runs with
  ``--enable-deterministic-inference``; otherwise sampling uses the server's RNG stream.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import requests
import torch
from tqdm.auto import tqdm

from ar_torchrl.backends._sglang_protocol import default_sglang_venv
from ar_torchrl.backends.base import Completion, GenerationBackend, SamplingParams, validate_prompts

__all__ = [
    "CPU_SERVER_ARGS",
    "SGLangAbortError",
    "SGLangBackend",
    "SGLangError",
    "SGLangLaunchError",
    "SGLangRequestError",
    "SGLangResponseError",
    "SGLangServer",
    "SGLangTimeoutError",
    "SGLangUnavailableError",
    "launch_sglang_server",
]

logger = logging.getLogger(__name__)

WeightSyncMode = Literal["disk", "tensor", "distributed"]
AbortPolicy = Literal["raise", "keep"]

#: ``sampling_params`` keys SGLang 0.5.23 accepts (``api_types.SamplingParams``); others are a 400.
SGLANG_SAMPLING_KEYS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty "
    "presence_penalty repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag "
    "ignore_eos skip_special_tokens spaces_between_special_tokens no_stop_trim stream_interval "
    "logit_bias sampling_seed custom_params beam_width watermark choice".split()
)


class SGLangError(RuntimeError):
    """Base class of the SGLang client's errors."""


class SGLangRequestError(SGLangError):
    """The server rejected a request (HTTP 4xx); ``status`` and ``server_message`` say why."""

    def __init__(self, message: str, *, status: int, server_message: str) -> None:
        super().__init__(message)
        self.status = status
        self.server_message = server_message


class SGLangUnavailableError(SGLangError):
    """No answer after all retries (connection refused/dropped, or HTTP 5xx)."""


class SGLangTimeoutError(SGLangError):
    """A request got no answer within its timeout (not retried: the server may still be busy)."""


class SGLangResponseError(SGLangError):
    """The answer breaks the protocol (counts disagree, missing log-probs, ...); never truncated."""


class SGLangAbortError(SGLangResponseError):
    """The server aborted one or more completions (counted in ``SGLangBackend.stats["aborted"]``)."""


class SGLangLaunchError(SGLangError):
    """The server process did not become healthy; the message ends with the tail of its log."""


# ---------------------------------------------------------------------------------------------
# HTTP transport: retries, backoff, error messages
# ---------------------------------------------------------------------------------------------


def server_error_message(response: requests.Response) -> str:
    """Extract SGLang's error text from an error response (its three JSON shapes, or raw text).

    Example:
        >>> r = requests.Response()
        >>> r.status_code, r._content = 400, b'{"error": "unknown field `max_tokens`"}'
        >>> server_error_message(r)
        'unknown field `max_tokens`'
    """
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:2000]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))
        if isinstance(err, str):
            return err
        return str(body.get("message", body))
    return str(body)[:2000]


@dataclass
class RetryPolicy:
    """Bounded retries with exponential backoff: wait ``base_s * 2**attempt`` (capped at ``max_s``).

    Example:
        >>> [RetryPolicy(max_retries=3, base_s=0.5, max_s=1.5).delay(a) for a in range(3)]
        [0.5, 1.0, 1.5]
    """

    max_retries: int = 3
    base_s: float = 0.5
    max_s: float = 8.0

    def delay(self, attempt: int) -> float:
        return min(self.base_s * 2**attempt, self.max_s)


class _Transport:
    """JSON over HTTP with the retry policy; counts retries in ``stats``."""

    def __init__(
        self, *, connect_timeout_s: float, retry: RetryPolicy, stats: dict, pool_size: int = 10
    ) -> None:
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=pool_size, pool_maxsize=pool_size)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.connect_timeout_s = connect_timeout_s
        self.retry = retry
        self.stats = stats
        self._lock = threading.Lock()

    def request(
        self,
        method: str,
        urls: Sequence[str],
        path: str,
        body: Any = None,
        *,
        timeout_s: float,
        retry: bool = True,
    ) -> Any:
        """Send ``body`` to ``urls[0] + path``; retries go to the next URL in ``urls`` (failover)."""
        attempts = self.retry.max_retries + 1 if retry else 1
        last = ""
        for attempt in range(attempts):
            if attempt:
                with self._lock:
                    self.stats["retries"] += 1
                time.sleep(self.retry.delay(attempt - 1))
            url = urls[attempt % len(urls)]
            try:
                response = self.session.request(
                    method, url + path, json=body, timeout=(self.connect_timeout_s, timeout_s)
                )
            except requests.exceptions.ReadTimeout as exc:
                raise SGLangTimeoutError(
                    f"SGLang {url}{path}: no answer within timeout_s={timeout_s}s; raise the "
                    "backend's `timeout_s` for long generations, or check the server log"
                ) from exc
            except (
                requests.exceptions.ConnectionError,
                requests.exceptions.ChunkedEncodingError,
            ) as exc:
                last = f"connection error: {exc.__class__.__name__}: {exc}"
            else:
                if response.status_code < 500:
                    return self._decode(response, url + path)
                last = f"HTTP {response.status_code}: {server_error_message(response)}"
            logger.warning(
                "SGLang %s%s attempt %d/%d failed: %s", url, path, attempt + 1, attempts, last
            )
        raise SGLangUnavailableError(
            f"SGLang {path}: no successful answer after {attempts} attempt(s) to {list(urls)}; last "
            f"failure: {last}. Is the server up? (see `launch_sglang_server` and its log)"
        )

    @staticmethod
    def _decode(response: requests.Response, where: str) -> Any:
        if response.status_code >= 400:
            message = server_error_message(response)
            raise SGLangRequestError(
                f"SGLang {where} rejected the request (HTTP {response.status_code}): {message}",
                status=response.status_code,
                server_message=message,
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise SGLangResponseError(
                f"SGLang {where}: answer is not JSON: {response.text[:300]!r}"
            ) from exc


# ---------------------------------------------------------------------------------------------
# Response parsing
# ---------------------------------------------------------------------------------------------


def _finish_type(item: Mapping, where: str) -> str:
    reason = item["meta_info"].get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else None
    if kind not in ("stop", "length", "abort"):
        raise SGLangResponseError(
            f"{where}: unexpected finish_reason {reason!r} (unfinished request?)"
        )
    return kind


def parse_generate_item(
    item: Mapping, prompt_index: int, where: str = "SGLang /generate"
) -> Completion:
    """Map one ``/generate`` answer item to a :class:`Completion`; check every count.

    Raises:
        SGLangResponseError: ``output_ids``, ``output_token_logprobs`` and ``completion_tokens``
            disagree in length or token ids, or a log-prob is missing (never truncated).

    Example:
        >>> item = {"output_ids": [7, 2], "meta_info": {"completion_tokens": 2,
        ...     "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "3",
        ...     "output_token_logprobs": [[-0.1, 7, None], [-0.2, 2, None]]}}
        >>> c = parse_generate_item(item, 0)
        >>> c.token_ids, c.log_probs, c.finish_reason, c.weight_version
        ([7, 2], [-0.1, -0.2], 'stop', '3')
    """
    meta = item.get("meta_info") or {}
    ids, lps = item.get("output_ids"), meta.get("output_token_logprobs")
    kind = _finish_type({"meta_info": meta}, where)
    if kind == "abort" and not ids and not lps:  # aborted while waiting: SGLang sends no tokens
        ids, lps = [], []
    if ids is None or lps is None:
        raise SGLangResponseError(
            f"{where}: answer lacks output_ids or meta_info.output_token_logprobs (keys "
            f"{sorted(item)}, meta {sorted(meta)}); the request must set return_logprob=true"
        )
    n_tokens = meta.get("completion_tokens", len(ids)) if kind != "abort" else len(ids)
    if not len(ids) == len(lps) == n_tokens:
        raise SGLangResponseError(
            f"{where}: prompt {prompt_index}: {len(ids)} output_ids, {len(lps)} "
            f"output_token_logprobs, completion_tokens={n_tokens}; they must agree"
        )
    bad = [i for i, (tok, entry) in enumerate(zip(ids, lps)) if entry[1] != tok or entry[0] is None]
    if bad:
        raise SGLangResponseError(
            f"{where}: prompt {prompt_index}: output_token_logprobs disagree with output_ids or are "
            f"null at positions {bad[:8]} (e.g. {lps[bad[0]]} vs token {ids[bad[0]]})"
        )
    return Completion(
        prompt_index=prompt_index,
        token_ids=[int(t) for t in ids],
        log_probs=[float(e[0]) for e in lps],
        finish_reason=kind,
        weight_version=meta.get("weight_version"),
        meta={"finish_reason": meta.get("finish_reason"), "id": meta.get("id")},
    )


# ---------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------


class SGLangBackend(GenerationBackend):
    """Rollouts from one or more SGLang servers over HTTP.

    One ``/generate`` request per prompt (``n`` samples each) runs on a thread pool of
    ``max_concurrency`` workers; requests go round-robin over ``urls``. Connection errors and HTTP
    5xx are retried (``max_retries``, exponential backoff, next URL); a 4xx raises
    :class:`SGLangRequestError` with the server's message; no answer within ``timeout_s`` raises
    :class:`SGLangTimeoutError`. Answers are checked (token, log-prob and count agreement) and
    aborted completions are counted in ``stats["aborted"]`` and raise :class:`SGLangAbortError`
    (``on_abort="raise"``) or are returned with ``finish_reason="abort"`` (``on_abort="keep"``).

    Args:
        urls: server base URL(s), e.g. ``"http://127.0.0.1:30000"`` (or an sglang-router URL).
        max_concurrency: in-flight ``/generate`` requests.
        timeout_s: read timeout of one ``/generate`` request (seconds).
        connect_timeout_s: TCP connect timeout.
        max_retries, backoff_s, backoff_max_s: retry policy for connection errors and 5xx.
        on_abort: what to do with completions the server aborted.
        extra_sampling_params: more SGLang ``sampling_params`` (e.g. ``{"ignore_eos": True}``);
            keys are checked against SGLang's schema here, not at the server.
        weight_sync: how :meth:`sync_weights` ships tensors (see ``ar_torchrl.weight_sync.sglang``).
        weight_sync_options: keyword arguments of that sender.
        sync_timeout_s: timeout of each weight-sync request.
        show_progress: tqdm bar over prompts (``None``: only on a terminal).

    Example:
        >>> backend = SGLangBackend("http://127.0.0.1:9", max_retries=0, connect_timeout_s=0.5)
        >>> backend.health()
        False
        >>> backend.generate([[1, 2, 3]], n=1, sampling=SamplingParams(max_new_tokens=2))
        Traceback (most recent call last):
        ...
        ar_torchrl.backends.sglang.SGLangUnavailableError: SGLang /generate: no successful answer ...
        >>> backend.close()
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        max_concurrency: int = 8,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        on_abort: AbortPolicy = "raise",
        extra_sampling_params: Mapping[str, Any] | None = None,
        weight_sync: WeightSyncMode = "disk",
        weight_sync_options: Mapping[str, Any] | None = None,
        sync_timeout_s: float = 600.0,
        show_progress: bool | None = None,
    ) -> None:
        self.urls = _check_urls(urls)
        if max_concurrency < 1:
            raise ValueError(f"SGLangBackend: max_concurrency must be >= 1, got {max_concurrency}")
        if on_abort not in ("raise", "keep"):
            raise ValueError(f"SGLangBackend: on_abort must be 'raise' or 'keep', got {on_abort!r}")
        self.extra_sampling_params = _check_sampling_keys(extra_sampling_params or {})
        self.timeout_s, self.sync_timeout_s = timeout_s, sync_timeout_s
        self.on_abort, self.show_progress = on_abort, show_progress
        self.stats = {"requests": 0, "retries": 0, "aborted": 0, "completions": 0, "tokens": 0}
        self._stats_lock = threading.Lock()
        retry = RetryPolicy(max_retries=max_retries, base_s=backoff_s, max_s=backoff_max_s)
        self._http = _Transport(
            connect_timeout_s=connect_timeout_s,
            retry=retry,
            stats=self.stats,
            pool_size=max(10, max_concurrency),
        )
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sglang")
        self._rr = itertools.count()
        self._sender = None
        self._weight_sync = weight_sync
        self._weight_sync_options = dict(weight_sync_options or {})
        self.weight_version: str | None = None

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def session(self) -> requests.Session:
        """The ``requests.Session`` every call goes through (wrap it to record traffic)."""
        return self._http.session

    def post(
        self, url: str, path: str, body: Any, *, timeout_s: float | None = None, retry: bool = True
    ) -> Any:
        """POST JSON to one server (``url + path``) with the retry policy; return the JSON answer."""
        return self._http.request(
            "POST", [url], path, body, timeout_s=timeout_s or self.sync_timeout_s, retry=retry
        )

    def get(self, url: str, path: str, *, timeout_s: float = 30.0) -> Any:
        """GET ``url + path`` with the retry policy; return the JSON answer."""
        return self._http.request("GET", [url], path, timeout_s=timeout_s)

    def _urls_from_next(self) -> list[str]:
        start = next(self._rr) % len(self.urls)
        return self.urls[start:] + self.urls[:start]

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for key, value in deltas.items():
                self.stats[key] += value

    # -- health --------------------------------------------------------------------------------

    def health(self) -> bool:
        """``True`` when every server answers ``GET /health`` with 200 (no retries)."""
        for url in self.urls:
            try:
                ok = self.session.get(
                    url + "/health", timeout=(self._http.connect_timeout_s, 10)
                ).ok
            except requests.exceptions.RequestException:
                ok = False
            if not ok:
                return False
        return True

    def wait_until_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> None:
        """Poll :meth:`health` until it is ``True``; raise :class:`SGLangUnavailableError` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.health():
            if time.monotonic() > deadline:
                raise SGLangUnavailableError(
                    f"SGLang servers {self.urls} not healthy after {timeout_s}s"
                )
            time.sleep(poll_s)

    # -- generation ----------------------------------------------------------------------------

    def request_body(
        self, prompt: Sequence[int], n: int, sampling: SamplingParams, prompt_index: int = 0
    ) -> dict:
        """The ``/generate`` body for one prompt.

        With ``sampling.seed`` set, the body is a batch of ``n`` copies of the prompt, each with its
        own ``sampling_seed = seed + prompt_index * n + j`` (one seed for ``n`` samples would make
        them identical); otherwise a single prompt with ``sampling_params.n = n``.

        Example:
            >>> b = SGLangBackend("http://127.0.0.1:9")
            >>> b.request_body([5, 6], 2, SamplingParams(max_new_tokens=4, temperature=0.0))
            {'input_ids': [5, 6], 'sampling_params': {'max_new_tokens': 4, 'temperature': 0.0, 'top_p': 1.0, 'top_k': -1, 'n': 2}, 'return_logprob': True}
            >>> b.close()
        """
        params = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
        }
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        params.update(self.extra_sampling_params)
        ids = [int(t) for t in prompt]
        if sampling.seed is None:
            return {"input_ids": ids, "sampling_params": {**params, "n": n}, "return_logprob": True}
        seeds = [sampling.seed + prompt_index * n + j for j in range(n)]
        return {
            "input_ids": [ids] * n,
            "sampling_params": [{**params, "sampling_seed": s} for s in seeds],
            "return_logprob": True,
        }

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        """Sample ``n`` completions per prompt; prompt-major flat list (item ``i * n + j``).

        Raises:
            ValueError: empty prompt list, empty prompt, or ``n < 1``.
            SGLangRequestError, SGLangUnavailableError, SGLangTimeoutError, SGLangResponseError,
            SGLangAbortError: see the class docstring.
        """
        prompts = validate_prompts(prompt_token_ids, n, "SGLangBackend")
        bodies = [self.request_body(p, n, sampling, i) for i, p in enumerate(prompts)]
        futures = [self._pool.submit(self._generate_one, body) for body in bodies]
        answers = []
        with tqdm(
            total=len(futures), desc="sglang generate", disable=self._no_progress(), leave=False
        ) as bar:
            for future in futures:
                answers.append(future.result())
                bar.update(1)
        return self._to_completions(answers, n)

    def _no_progress(self) -> bool | None:
        return None if self.show_progress is None else not self.show_progress

    def _generate_one(self, body: dict) -> list[dict]:
        self._count(requests=1)
        answer = self._http.request(
            "POST", self._urls_from_next(), "/generate", body, timeout_s=self.timeout_s
        )
        return answer if isinstance(answer, list) else [answer]

    def _to_completions(self, answers: list[list[dict]], n: int) -> list[Completion]:
        completions, aborted = [], []
        for i, items in enumerate(answers):
            if len(items) != n:
                raise SGLangResponseError(
                    f"SGLang /generate: prompt {i}: asked n={n}, got {len(items)} items"
                )
            items = sorted(items, key=lambda it: it.get("index") or 0)
            for item in items:
                c = parse_generate_item(item, i)
                if c.finish_reason == "abort":
                    aborted.append((i, c.meta["finish_reason"]))
                completions.append(c)
        self._count(
            aborted=len(aborted), completions=len(completions), tokens=sum(map(len, completions))
        )
        if aborted and self.on_abort == "raise":
            raise SGLangAbortError(
                f"SGLang aborted {len(aborted)} of {len(completions)} completions (prompt, reason): "
                f"{aborted[:4]}; pass on_abort='keep' to receive them with finish_reason='abort'"
            )
        return completions

    # -- weights -------------------------------------------------------------------------------

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Send new policy weights to every server; afterwards each reports ``weight_version == str(version)``.

        ``value_head.*`` tensors are dropped (and asserted absent) by the sender.

        Raises:
            WeightSyncError: the server rejected the update or reports another version.
        """
        from ar_torchrl.weight_sync.sglang import make_sender

        if self._sender is None:
            self._sender = make_sender(self._weight_sync, self, **self._weight_sync_options)
        self._sender.send(named_tensors, str(version))
        self.weight_version = str(version)

    def close(self) -> None:
        """Release the weight-sync group, the thread pool and the HTTP session. Idempotent."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.session.close()


def _check_urls(urls: str | Sequence[str]) -> list[str]:
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise ValueError("SGLangBackend: `urls` is empty; pass at least one server URL")
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"SGLangBackend: URLs must start with http:// or https://, got {bad}")
    return [u.rstrip("/") for u in urls]


def _check_sampling_keys(params: Mapping[str, Any]) -> dict:
    unknown = sorted(set(params) - SGLANG_SAMPLING_KEYS)
    if unknown:
        raise ValueError(
            f"SGLangBackend: extra_sampling_params has keys SGLang rejects with HTTP 400: {unknown}; "
            f"allowed: {sorted(SGLANG_SAMPLING_KEYS)}"
        )
    reserved = sorted(
        set(params) & {"n", "max_new_tokens", "temperature", "top_p", "top_k", "sampling_seed"}
    )
    if reserved:
        raise ValueError(
            f"SGLangBackend: set {reserved} through SamplingParams / `n`, not extra_sampling_params"
        )
    return dict(params)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

#: Flags that run SGLang 0.5.23 on a CPU (tiny models): torch-native attention, fp32, no CUDA graphs.
CPU_SERVER_ARGS = (
    "--attention-backend", "torch_native", "--dtype", "float32", "--max-total-tokens", "4096",
    "--context-length", "512", "--cuda-graph-backend-decode", "disabled",
    "--cuda-graph-backend-prefill", "disabled", "--skip-server-warmup", "--mem-fraction-static", "0.1",
)  # fmt: skip


@dataclass
class SGLangServer:
    """A server started by :func:`launch_sglang_server`."""

    url: str
    process: subprocess.Popen
    log_path: Path
    port: int


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``, outside the kernel's ephemeral range.

    SGLang's own processes bind ~10 ports with ``bind(0)``, which the kernel takes from the
    ephemeral range (32768-60999 on Linux); drawing ours below it makes a collision between our
    HTTP port and theirs unlikely (the launcher still retries if one happens).

    Example:
        >>> 20000 <= free_port() < 32000
        True
    """
    rng = random.Random()
    for _ in range(200):
        candidate = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, candidate))
            except OSError:
                continue
            return candidate
    raise OSError(f"free_port: no free port found in 20000-31999 on {host}")


def _server_python(python: str | Path | None) -> Path:
    path = Path(python) if python is not None else default_sglang_venv() / "bin" / "python"
    if not path.exists():
        raise FileNotFoundError(
            f"SGLang server python {path} not found. Run `bash scripts/setup_sglang_env.sh` to create "
            "the server venv (or pass python=... / set AR_TORCHRL_SGLANG_VENV)"
        )
    return path


def _shim_dir(python: Path, shim_dir: str | Path | None) -> Path:
    if shim_dir is not None:
        return Path(shim_dir)
    for candidate in (
        python.parent.parent / "sgl_kernel_shim",
        Path(__file__).resolve().parents[2] / "tools" / "sgl_kernel_shim",
    ):
        if (candidate / "sgl_kernel" / "__init__.py").is_file():
            return candidate
    raise FileNotFoundError(
        f"sgl_kernel import shim not found next to {python} or in tools/; run `bash scripts/setup_sglang_env.sh`"
    )


def _server_env(device: str, shim: Path, env: Mapping[str, str] | None) -> dict[str, str]:
    out = dict(os.environ)
    out.update(env or {})
    if device == "cpu":
        out["SGLANG_USE_CPU_ENGINE"] = "1"
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), out.get("PYTHONPATH", "")) if p)
    return out


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (``""`` when missing)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def _wait_healthy(server: SGLangServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SGLangLaunchError(
                f"SGLang server exited with code {server.process.returncode} before becoming healthy; "
                f"log {server.log_path}:\n{log_tail(server.log_path)}"
            )
        with contextlib.suppress(requests.exceptions.RequestException):
            if requests.get(server.url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise SGLangLaunchError(
        f"SGLang server not healthy after {timeout_s}s; log {server.log_path}:\n{log_tail(server.log_path)}"
    )


def stop_server(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server's main pid, SIGKILL it after ``grace_s``, then SIGKILL stray children."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # its own session: only its children are left in it


@contextlib.contextmanager
def launch_sglang_server(
    model_path: str | Path,
    *,
    python: str | Path | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
    device: str = "cpu",
    extra_args: Sequence[str] = (),
    log_file: str | Path | None = None,
    timeout_s: float = 300.0,
    shim_dir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[SGLangServer]:
    """Start ``python -m sglang.launch_server`` and stop it on exit.

    stdout/stderr go to ``log_file`` (SGLang's children inherit stdout, so a pipe would block),
    stdin is ``/dev/null``; on ``device="cpu"`` the env gets ``SGLANG_USE_CPU_ENGINE=1`` and the
    ``sgl_kernel`` shim on ``PYTHONPATH``, and :data:`CPU_SERVER_ARGS` are passed before
    ``extra_args`` (later flags win). Waits for ``GET /health`` == 200.

    Args:
        model_path: HF model directory.
        python: the server venv's interpreter (default ``.venv-sglang/bin/python``).
        port: HTTP port (default: a free one).
        log_file: where the server writes (default: a temp file).
        timeout_s: how long to wait for health.

    Raises:
        FileNotFoundError: no server venv (run ``bash scripts/setup_sglang_env.sh``).
        SGLangLaunchError: the server exited or timed out; the message has the log's tail.

    Example:
        >>> with launch_sglang_server("model", python="/nonexistent/python"):
        ...     pass
        Traceback (most recent call last):
        ...
        FileNotFoundError: SGLang server python /nonexistent/python not found. Run `bash scripts/setup_sglang_env.sh` ...
    """
    python = _server_python(python)
    log_path = Path(log_file) if log_file else Path(_tempfile("sglang-server-", ".log"))
    attempts = 1 if port else 3  # an auto-picked port can be taken by SGLang's own children
    for attempt in range(1, attempts + 1):
        try:
            server = _start_server(python, model_path, port or free_port(host), host, device,
                                   extra_args, log_path, timeout_s, shim_dir, env)  # fmt: skip
            break
        except _PortTaken as err:
            if attempt == attempts:
                raise SGLangLaunchError(str(err)) from err
            logger.warning("SGLang: %s; retrying on another port (%d/%d)", err, attempt, attempts)
    try:
        yield server
    finally:
        stop_server(server.process)


class _PortTaken(SGLangLaunchError):
    """The server could not bind its HTTP port (taken between our pick and its bind)."""


def _start_server(python, model_path, port, host, device, extra_args, log_path, timeout_s,
                  shim_dir, env) -> SGLangServer:  # fmt: skip
    """Start one server process and wait until it is healthy (stopping it on failure)."""
    cmd = [str(python), "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host,
           "--port", str(port), "--device", device]  # fmt: skip
    cmd += list(CPU_SERVER_ARGS if device == "cpu" else ()) + list(extra_args)
    logger.info("launching SGLang: %s (log %s)", " ".join(cmd), log_path)
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=_server_env(device, _shim_dir(python, shim_dir), env), start_new_session=True,
        )  # fmt: skip
    server = SGLangServer(
        url=f"http://{host}:{port}", process=process, log_path=log_path, port=port
    )
    try:
        _wait_healthy(server, timeout_s)
    except SGLangLaunchError as err:
        stop_server(process)
        with open(log_path, "rb") as f:
            f.seek(offset)
            if b"address already in use" in f.read():
                raise _PortTaken(f"port {port} was taken before the server bound it") from err
        raise
    logger.info("SGLang server healthy at %s (pid %d)", server.url, process.pid)
    return server


def _tempfile(prefix: str, suffix: str) -> str:
    import tempfile

    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return path
