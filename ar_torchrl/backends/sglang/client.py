"""``SGLangBackend``: rollouts from one or more SGLang servers over HTTP, synced by a ``WeightSender``.

The client speaks HTTP only (``requests``); nothing from ``sglang`` (which pins its own torch) is
imported. Requests are spread round-robin over the servers; every weight sync reaches every server
(in parallel) and changes :attr:`policy_version` only when all of them succeeded; every completion
is checked against the version the server reports, so a batch never mixes two versions.

**Stalled servers.** While ``/generate`` requests are in flight, each server's silence is tracked:
the time since its last sign of life (an answer, or a passed ``GET /health_generate`` probe, which
SGLang answers only while its scheduler makes progress), counted from the oldest request it holds.
A server silent for ``stall_grace_s / 2`` is named in a warning; one silent for ``stall_grace_s``
is marked stalled: its requests are cancelled there (their sockets are shut down, so SGLang drops
them when it wakes up; an answer that still arrives is discarded, never counted) and sent again to
the other servers, and it gets no new request until a probe passes again. With no other server
answering, the client keeps waiting (up to ``timeout_s``) and says so every ``stall_grace_s``.
Weight syncs still go to every server, stalled or not: a stalled server fails the sync
(``sync_timeout_s``) and the version stays unchanged.

**Behind an sglang-router** (``router_url``): every ``/generate`` request goes to the router, which
picks a worker; weight syncs go to each worker directly (the router has no weight-update route),
the given ``urls`` or, by default, the workers the router lists (``GET /workers``, read again
before every sync). Seeded requests go one sample per request, and ``extra_sampling_params`` the
router would drop are refused (see :mod:`~ar_torchrl.backends.sglang.router`). Stall detection then
watches the router: requests move between workers only through the router's own retries.

**Partial rollouts** (``partial_rollouts = True``): every request then carries one sample and its
own ``rid``. When a weight sync is waiting (:attr:`interrupted`), the requests not sent yet stay
home and every request in flight is aborted with SGLang's ``POST /abort_request {"rid": ...}`` (to
the server it is on; behind a router, to every worker: the router has no abort route). SGLang
answers an aborted request at its next step with the tokens and log-probs it has and
``finish_reason = {"type": "abort", "message": "Aborted", ...}``; those completions come back with
``finish_reason="abort"`` (none of them raises, whatever ``on_abort``), the base class syncs and
continues each from ``prompt + tokens so far``. An abort that reaches SGLang's scheduler before its
request (a short window while the server tokenizes it) is lost for good: aborts are sent again
every ``ABORT_REPEAT_S`` and, for requests still running ``abort_all_after_s`` later, the servers
holding them get ``{"abort_all": true}`` (other clients' requests there end too; logged).

**Colocated memory** (:meth:`SGLangBackend.release_memory`, :meth:`SGLangBackend.resume_memory`):
see :mod:`~ar_torchrl.backends.sglang.memory`; generation is refused while the memory is released
and until a sync after the resume.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal

import requests
import torch
from tqdm.auto import tqdm

from ar_torchrl.backends.base import (
    BackendCapabilities,
    Completion,
    GenerationBackend,
    SamplingParams,
)
from ar_torchrl.backends.sglang.errors import (
    SGLangAbortError,
    SGLangError,
    SGLangResponseError,
    SGLangUnavailableError,
)
from ar_torchrl.backends.sglang.http import (
    DEFAULT_MAX_RESPONSE_BYTES,
    Flight,
    HttpClient,
    RetryPolicy,
)
from ar_torchrl.backends.sglang.launcher import API_KEY_ENV
from ar_torchrl.backends.sglang.memory import MemoryLifecycle, Probe
from ar_torchrl.backends.sglang.options import SGLangClientOptions
from ar_torchrl.backends.sglang.protocol import (
    check_sampling_keys,
    generate_body,
    parse_generate_answer,
    single_samples,
)
from ar_torchrl.backends.sglang.router import (
    ROUTER_DROPPED_SAMPLING_KEYS,
    ROUTER_VERSION,
    router_workers,
)
from ar_torchrl.registry import closest
from ar_torchrl.weight_sync.base import WeightSender
from ar_torchrl.weight_sync.errors import WeightSyncError
from ar_torchrl.weight_sync.registry import make_sender

__all__ = ["SGLangBackend"]

logger = logging.getLogger(__name__)

#: partial rollouts: aborts of requests still in flight are sent again this often (seconds)
ABORT_REPEAT_S = 0.5
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class _Server:
    """What the stall detection knows of one server (guarded by ``SGLangBackend._watch_lock``)."""

    url: str
    alive_at: float = -math.inf  # last sign of life: an answer, or a passed probe (monotonic)
    stalled: bool = False  # silent past the grace period: no new request until it answers again
    probe: Flight | None = None  # the probe in flight
    probe_at: float = -math.inf  # when the last probe was sent
    warned_for: float | None = None  # start of the silence already warned about
    waiting_said_at: float = -math.inf  # last "nowhere to move its requests" warning


@dataclass
class _Job:
    """One ``/generate`` request; ``attempt`` counts its sends (a move sends it again).

    Partial rollouts: ``rid`` names it for ``/abort_request``; ``aborted``: an abort was sent;
    ``unsent``: an interruption kept it home (it comes back without tokens)."""

    body: dict
    attempt: int = 0
    flight: Flight | None = None
    answer: Any = None
    done: bool = False
    rid: str | None = None
    aborted: bool = False
    unsent: bool = False


class SGLangBackend(GenerationBackend):
    """Rollouts from one or more SGLang servers over HTTP.

    One ``/generate`` request per prompt (``n`` samples each) runs on a pool of ``max_concurrency``
    threads, round-robin over ``urls``. Transport (:class:`~ar_torchrl.backends.sglang.http.HttpClient`):
    connection errors and HTTP 5xx are retried with backoff on the next URL, a 4xx raises
    ``SGLangRequestError`` with the server's message, ``timeout_s`` bounds each whole answer, answers
    above ``max_response_bytes`` are refused. Answers are checked field by field
    (:mod:`~ar_torchrl.backends.sglang.protocol`); aborted completions are counted in
    ``stats["aborted"]`` and raise :class:`SGLangAbortError` (``on_abort="raise"``) or are returned
    with ``finish_reason="abort"`` (``on_abort="keep"``). A server that stays silent for
    ``stall_grace_s`` has its requests moved to the other servers (see the module docstring;
    ``stats["moved"]`` counts them, ``stats["discarded"]`` the late answers that were dropped).
    It supports partial rollouts (a sync aborts the requests in flight: ``stats["interrupted"]``
    counts the completions it cut, ``stats["abort_requests"]`` the ``/abort_request`` calls) and
    the colocated memory lifecycle (:meth:`release_memory`, :meth:`resume_memory`).

    Args:
        urls: server base URL(s), e.g. ``"http://127.0.0.1:30000"``, or a list of them: the
            servers that hold the weights (each one is synced). With ``router_url``: ``None``
            (default) reads them from the router before every sync.
        router_url: an ``sglang-router`` in front of the servers: every ``/generate`` goes there
            (see the module docstring).
        weight_sync: a registered SGLang sync method (``"disk"``, ``"tensor"``, ``"distributed"``;
            see :mod:`ar_torchrl.weight_sync.registry`) or a factory ``client -> WeightSender``.
        weight_sync_options: keyword arguments of that sender.
        options: how the client talks to the servers (timeouts, retries, concurrency, stall
            detection, aborts, ...): :class:`~ar_torchrl.backends.sglang.options.SGLangClientOptions`.
            Its fields as keywords (``SGLangBackend(url, timeout_s=30)``, the 0.1 signature) still
            work for one release, with a ``DeprecationWarning``.

    Example:
        >>> quick = SGLangClientOptions(max_retries=0, connect_timeout_s=0.5)
        >>> backend = SGLangBackend("http://127.0.0.1:9", options=quick)
        >>> backend.health()
        False
        >>> backend.generate([[1, 2, 3]], n=1, sampling=SamplingParams(max_new_tokens=2))
        Traceback (most recent call last):
        ...
        ar_torchrl.backends.sglang.errors.SGLangUnavailableError: the SGLang server at http://127.0.0.1:9 is not reachable (...
        >>> backend.close()

        Behind a router, the workers are read from it when first needed:

        >>> routed = SGLangBackend(router_url="http://127.0.0.1:9", options=quick)
        >>> routed.route_urls, routed.health()
        (['http://127.0.0.1:9'], False)
        >>> routed.close()

        Partial rollouts and the memory lifecycle:

        >>> backend = SGLangBackend("http://127.0.0.1:9")
        >>> backend.partial_rollouts = True
        >>> backend.memory_state
        'resident'
        >>> backend.close()
    """

    capabilities = BackendCapabilities(partial_rollouts=True, memory_release=True)

    def __init__(
        self,
        urls: str | Sequence[str] | None = None,
        *,
        router_url: str | None = None,
        weight_sync: str | Callable[[SGLangBackend], WeightSender] = "disk",
        weight_sync_options: Mapping[str, Any] | None = None,
        options: SGLangClientOptions | None = None,
        **keywords: Any,
    ) -> None:
        self.options = o = _client_options(options, keywords)
        o.check("SGLangBackend")
        if router_url is None:
            if urls is None:
                raise ValueError(
                    "SGLangBackend: pass the servers' `urls`, or the `router_url` of an "
                    "sglang-router in front of them"
                )
            self.route_urls = _check_urls(urls)
            self._workers: list[str] | None = self.route_urls
        else:
            self.route_urls = _check_urls(router_url, what="router_url")
            if len(self.route_urls) != 1:
                raise ValueError(f"SGLangBackend: router_url is one URL, got {router_url!r}")
            self._workers = None if urls is None else _check_urls(urls)
        self.router_url = None if router_url is None else self.route_urls[0]
        self._discover = self.router_url is not None and urls is None
        self.abort_all_after_s = o.abort_all_after_s
        self.extra_sampling_params = check_sampling_keys(o.extra_sampling_params or {})
        dropped = sorted(set(self.extra_sampling_params) & ROUTER_DROPPED_SAMPLING_KEYS)
        if self.router_url is not None and dropped:
            raise ValueError(
                f"SGLangBackend: extra_sampling_params {dropped} would be dropped without a word "
                f"by the sglang-router ({ROUTER_VERSION}) at {self.router_url}: leave them out, or "
                "send to the servers directly (urls=..., no router_url)"
            )
        self.api_key = o.api_key if o.api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.timeout_s, self.sync_timeout_s = o.timeout_s, o.sync_timeout_s
        self.vocab_size, self.on_abort, self.show_progress = (
            o.vocab_size,
            o.on_abort,
            o.show_progress,
        )
        self.stall_grace_s, self.probe_path = grace, _ = o.stall_grace_s, o.probe_path
        # probes every grace/5 (at most every 5 s) while a server is silent; looks 2x as often
        self._probe_every = None if grace is None else min(5.0, grace / 5)
        self._tick = None if grace is None else min(0.25, self._probe_every / 2)
        self.stats = {
            "requests": 0,
            "aborted": 0,
            "completions": 0,
            "tokens": 0,
            "moved": 0,
            "discarded": 0,
            "interrupted": 0,
            "abort_requests": 0,
        }
        self._stats_lock = threading.Lock()
        self._http = HttpClient(
            api_key=self.api_key,
            connect_timeout_s=o.connect_timeout_s,
            retry=RetryPolicy(max_retries=o.max_retries, base_s=o.backoff_s, max_s=o.backoff_max_s),
            max_response_bytes=o.max_response_bytes or DEFAULT_MAX_RESPONSE_BYTES,
            pool_size=max(10, o.max_concurrency),
        )
        self._pool = ThreadPoolExecutor(max_workers=o.max_concurrency, thread_name_prefix="sglang")
        self._probes = ThreadPoolExecutor(
            max_workers=len(self.route_urls), thread_name_prefix="sglang-probe"
        )
        self._aborts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-abort")
        self._servers = {url: _Server(url) for url in self.route_urls}
        self._watch_lock = threading.Lock()
        self._rr = itertools.count()
        self._server_info: list[dict] | None = None
        self._synced = False
        if callable(weight_sync):
            sender = weight_sync(self)
        else:
            sender = make_sender(
                weight_sync, self, engine="sglang", **dict(weight_sync_options or {})
            )
        super().__init__(sender)
        self._memory = MemoryLifecycle(self, self._engine_lock, timeout_s=o.sync_timeout_s)

    # -- plumbing (also what the senders use: urls, api_key, post, get) ------------------------

    @property
    def session(self) -> requests.Session:
        """The ``requests.Session`` every call goes through (wrap it to record traffic)."""
        return self._http.session

    def post(
        self,
        url: str,
        path: str,
        body: Any,
        *,
        timeout_s: float | None = None,
        retry: bool = True,
        decode: bool = True,
        idempotent: bool = True,
    ) -> Any:
        """POST JSON to one server (``url + path``) with the retry policy; return the JSON answer
        (``decode=False``: its text, for SGLang's plain-text answers such as ``/flush_cache``;
        ``idempotent=False``: retried only when it never reached the server)."""
        return self._http.request(
            "POST",
            [url],
            path,
            body,
            timeout_s=timeout_s or self.sync_timeout_s,
            retry=retry,
            decode=decode,
            idempotent=idempotent,
        )

    def get(self, url: str, path: str, *, timeout_s: float | None = None) -> Any:
        """GET ``url + path`` with the retry policy; return the JSON answer (default deadline: 30 s,
        or ``sync_timeout_s`` if shorter)."""
        timeout_s = timeout_s or min(30.0, self.sync_timeout_s)
        return self._http.request("GET", [url], path, timeout_s=timeout_s)

    @property
    def urls(self) -> list[str]:
        """The servers that hold the weights (every sync reaches each): the given ``urls``, or
        the workers the router lists (read on first use and again before every sync)."""
        if self._workers is None:
            self.refresh_workers()
        return list(self._workers)

    def refresh_workers(self) -> list[str]:
        """Read the workers from the router (``GET <router_url>/workers``) when they were not
        given, and return :attr:`urls`; a change since the last read is logged.

        Raises:
            SGLangError: the router does not answer or lists no usable worker.
        """
        if self.router_url is None or (self._workers is not None and not self._discover):
            return list(self._workers)
        listed = router_workers(self.get(self.router_url, "/workers"), self.router_url)
        urls = sorted(w.url for w in listed)  # the router lists them in registration order
        if self._workers is not None and urls != self._workers:
            logger.warning(
                "sglang-router %s: workers changed: added %s, removed %s",
                self.router_url,
                sorted(set(urls) - set(self._workers)),
                sorted(set(self._workers) - set(urls)),
            )
            self._server_info = None
        unhealthy = [w.url for w in listed if not w.healthy]
        if unhealthy:
            logger.warning(
                "sglang-router %s marks %s unhealthy; they are still synced (the router sends "
                "them requests again once they pass its health check)",
                self.router_url,
                unhealthy,
            )
        self._workers = urls
        return list(urls)

    def _urls_from_next(self) -> list[str]:
        start = next(self._rr) % len(self.route_urls)
        return self.route_urls[start:] + self.route_urls[:start]

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for key, value in deltas.items():
                self.stats[key] += value

    @property
    def retries(self) -> int:
        """Requests retried so far (connection errors, 5xx)."""
        return self._http.stats["retries"]

    # -- health and server facts ----------------------------------------------------------------

    def health(self) -> bool:
        """``True`` when every server (and the router, with one) answers ``GET /health`` with 200
        (no retries)."""
        try:
            urls = list(dict.fromkeys(self.route_urls + self.urls))
        except SGLangError as err:  # the router cannot list its workers
            logger.debug("SGLangBackend: no worker list from %s: %s", self.router_url, err)
            return False
        for url in urls:
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
                    f"SGLang servers {self.route_urls} not healthy after {timeout_s}s"
                )
            time.sleep(poll_s)

    def server_info(self) -> list[dict]:
        """``GET /server_info`` of every server (read once, then cached)."""
        if self._server_info is None:
            self._server_info = [self.get(url, "/server_info") or {} for url in self.urls]
        return self._server_info

    @property
    def context_length(self) -> int | None:
        """The smallest ``context_length`` the servers report (``None`` if one does not say)."""
        lengths = [info.get("context_length") for info in self.server_info()]
        return None if any(not isinstance(n, int) for n in lengths) else min(lengths)

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The servers' ``--dtype`` (``None`` for ``auto``, when they disagree, or cannot say: then
        the sync itself reports the problem)."""
        try:
            infos = self.server_info()
        except SGLangError as err:
            logger.debug("SGLangBackend: no /server_info for the weight dtype: %s", err)
            return None
        dtypes = {_DTYPES.get(str(info.get("dtype"))) for info in infos}
        return dtypes.pop() if len(dtypes) == 1 else None

    # -- generation ----------------------------------------------------------------------------

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        self._memory.check_can_generate()
        # (prompt index, completions in the answer, body)
        bodies = [
            (i, n, generate_body(p, n, sampling, i, self.extra_sampling_params))
            for i, p in enumerate(prompts)
        ]
        abortable = self._partial_rollouts  # one sample per request, each with its own rid
        if abortable or (self.router_url is not None and sampling.seed is not None):
            bodies = [(i, 1, one) for i, _, body in bodies for one in single_samples(body)]
        jobs = [_Job(body) for _, _, body in bodies]
        if abortable:
            for job in jobs:
                job.rid = job.body["rid"] = f"ar-torchrl-{uuid.uuid4().hex}"
        self._run(jobs)
        completions: list[Completion] = []
        for (i, k, _), job in zip(bodies, jobs):
            if job.unsent:  # kept home by an interruption: continues after the sync
                completions += [_unsent(i, job.rid) for _ in range(k)]
                continue
            got = parse_generate_answer(job.answer, k, i, vocab_size=self.vocab_size)
            for c in got:
                c.meta["interrupted"] = job.aborted and c.finish_reason == "abort"
            completions += got
        self._check_server_versions(completions)
        return self._count_aborts(completions)

    def _run(self, jobs: list[_Job]) -> None:
        """Send every job, watch the servers while they wait, move the jobs of a stalled one; each
        job keeps the answer of its *last* send only. With partial rollouts, an interruption keeps
        the jobs not sent yet home and aborts the others (:class:`_Aborter`)."""
        futures: dict[Future, tuple[_Job, int]] = {}
        abortable = self._partial_rollouts
        aborter: _Aborter | None = None
        bar = tqdm(
            total=len(jobs),
            desc="sglang generate",
            leave=False,
            disable=None if self.show_progress is None else not self.show_progress,
        )

        def finish(job: _Job) -> None:
            job.done = True
            bar.update(1)

        def send(job: _Job) -> None:
            job.attempt += 1
            if aborter is not None:  # interrupted: nothing new goes out (a move included)
                job.unsent = True
                finish(job)
                return
            job.flight = Flight()
            future = self._pool.submit(self._send, job.body, job.flight, job.attempt == 1)
            futures[future] = (job, job.attempt)

        for job in jobs:
            send(job)
        tick = self._tick
        if abortable:  # notice an interruption within ~20 ms
            tick = 0.02 if tick is None else min(tick, 0.02)
        try:
            with bar:
                while not all(job.done for job in jobs):
                    done, _ = wait(list(futures), timeout=tick, return_when=FIRST_COMPLETED)
                    for future in done:
                        job, attempt = futures.pop(future)
                        if attempt != job.attempt:  # sent again elsewhere: this answer is not used
                            if not future.cancelled() and future.exception() is None:
                                self._count(discarded=1)
                                logger.info(
                                    "SGLang: a late answer of a moved request was discarded"
                                )
                            continue
                        job.answer = future.result()
                        finish(job)
                    pending = [job for job in jobs if not job.done]
                    if abortable and pending and self.interrupted:
                        if aborter is None:
                            aborter = _Aborter(self)
                            for future, (job, _) in list(futures.items()):
                                if not job.done and future.cancel():  # still queued here
                                    del futures[future]
                                    job.attempt += 1
                                    job.unsent = True
                                    finish(job)
                            pending = [job for job in jobs if not job.done]
                        aborter.tick(pending)
                    if pending and self.stall_grace_s is not None:
                        self._watch(pending, send)
        finally:  # an error (or an interrupt): nothing of this call stays in flight
            for job in jobs:
                if not job.done and job.flight is not None:
                    job.flight.cancel()
            if aborter is not None:  # no abort of this call may reach the next round's requests
                aborter.close()

    def _abort_targets(self, job: _Job) -> list[str]:
        """The servers an abort of ``job`` goes to: the one it is on; behind a router (which
        has no abort route), or before it is connected, every server it may be on."""
        if self.router_url is None:
            url = job.flight.url if job.flight is not None else None
            return [url] if url is not None else list(self.route_urls)
        return self.urls

    def _send(self, body: dict, flight: Flight, first: bool) -> Any:
        if first:  # a moved request is counted once
            self._count(requests=1)
        answer = self._http.request(
            "POST", self._route(), "/generate", body, timeout_s=self.timeout_s, flight=flight
        )
        self._alive(flight.url)
        return answer

    def _route(self) -> list[str]:
        """The servers in round-robin order, stalled ones left out (unless all are stalled)."""
        order = self._urls_from_next()
        with self._watch_lock:
            answering = [url for url in order if not self._servers[url].stalled]
        return answering or order

    def _alive(self, url: str | None) -> None:
        with self._watch_lock:
            server = self._servers.get(url)
            if server is None:
                return
            server.alive_at = time.monotonic()
            if server.stalled:
                server.stalled = False
                logger.warning("SGLang server %s answers again: it takes requests again", url)

    def _watch(self, pending: list[_Job], send: Callable[[_Job], None]) -> None:
        """Probe silent servers, warn about them, and move the jobs of a stalled one."""
        grace, now = self.stall_grace_s, time.monotonic()
        held: dict[str, list[_Job]] = {}
        for job in pending:
            flight = job.flight
            if flight is not None and flight.url is not None and not flight.cancelled:
                held.setdefault(flight.url, []).append(job)
        with self._watch_lock:
            for server in self._servers.values():
                jobs = held.get(server.url, [])
                if not jobs and not server.stalled:
                    continue
                oldest = min((job.flight.since for job in jobs), default=-math.inf)
                since = max(server.alive_at, oldest)
                silent = now - since
                if (
                    silent >= self._probe_every
                    and server.probe is None
                    and now - server.probe_at >= self._probe_every
                ):
                    server.probe, server.probe_at = Flight(), now
                    self._probes.submit(self._probe, server, server.probe)
                if not jobs:
                    continue
                if silent >= grace / 2 and server.warned_for != since:
                    server.warned_for = since
                    logger.warning(
                        "SGLang server %s has been silent for %.1f s with %d request(s) in flight; "
                        "they move to the other server(s) if it stays silent for stall_grace_s=%gs",
                        server.url,
                        silent,
                        len(jobs),
                        grace,
                    )
                if silent >= grace:
                    self._move(server, jobs, silent, send, now)

    def _move(
        self,
        server: _Server,
        jobs: list[_Job],
        silent: float,
        send: Callable[[_Job], None],
        now: float,
    ) -> None:
        server.stalled = True
        others = [s.url for s in self._servers.values() if not s.stalled]
        if not others:
            if now - server.waiting_said_at >= self.stall_grace_s:
                server.waiting_said_at = now
                logger.warning(
                    "SGLang server %s has been silent for %.1f s with %d request(s) in flight and "
                    "no other server answers to move them to; waiting for it (timeout_s=%gs)",
                    server.url,
                    silent,
                    len(jobs),
                    self.timeout_s,
                )
            return
        for job in jobs:
            job.flight.cancel()
            send(job)
        self._count(moved=len(jobs))
        logger.warning(
            "SGLang server %s has been silent for %.1f s (stall_grace_s=%gs): moved its %d "
            "request(s) to %s; it gets no new request until it answers %s again",
            server.url,
            silent,
            self.stall_grace_s,
            len(jobs),
            others,
            self.probe_path,
        )

    def _probe(self, server: _Server, flight: Flight) -> None:
        ok = self._http.probe(
            server.url, self.probe_path, timeout_s=self.stall_grace_s, flight=flight
        )
        with self._watch_lock:
            server.probe = None
        if ok:
            self._alive(server.url)

    def _check_server_versions(self, completions: list[Completion]) -> None:
        """After a sync, every completion must come from that version (another client may have
        synced the server, or a server missed a sync); before any sync, from one version."""
        reported = {
            c.meta["server_weight_version"] for c in completions if not c.meta.get("unsent")
        }
        if not reported:  # nothing was answered (an interruption kept every request home)
            return
        expected = {str(self.policy_version)} if self._synced else reported
        if len(reported) > 1 or reported != expected:
            raise SGLangResponseError(
                f"SGLang /generate: meta_info.weight_version is {sorted(map(str, reported))} but this "
                f"backend {'synced version ' + str(self.policy_version) if self._synced else 'never synced'}: "
                "another client changed a server's weights, or a server missed a sync; sync again"
            )

    def _count_aborts(self, completions: list[Completion]) -> list[Completion]:
        aborted = [
            (c.prompt_index, c.meta["finish_reason"])
            for c in completions
            if c.finish_reason == "abort" and not c.meta.get("interrupted")
        ]
        self._count(
            aborted=len(aborted),
            interrupted=sum(bool(c.meta.get("interrupted")) for c in completions),
            completions=len(completions),
            tokens=sum(map(len, completions)),
        )
        if aborted and self.on_abort == "raise":
            raise SGLangAbortError(
                f"SGLang aborted {len(aborted)} of {len(completions)} completions (prompt, reason): "
                f"{aborted[:4]}; pass on_abort='keep' to receive them with finish_reason='abort'"
            )
        return completions

    # -- weights and lifecycle --------------------------------------------------------------------

    def sync_weights(self, named_tensors, version: int) -> None:
        """Send new weights to every server (see :meth:`GenerationBackend.sync_weights`); afterwards
        each reports ``weight_version == str(version)`` and its cache is flushed. Behind a router
        whose workers were not given, they are read from it first."""
        if self._discover:
            try:
                self.refresh_workers()
            except SGLangError as err:
                raise WeightSyncError(
                    f"SGLangBackend: weight sync to version {version} not started: the workers of "
                    f"the sglang-router could not be read ({err}); the engine keeps policy_version "
                    f"{self.policy_version}"
                ) from None
        self._memory.check_can_sync()
        super().sync_weights(named_tensors, version)
        self._synced = True
        self._weights_loaded()  # (the SGLang senders already did, inside the sync)

    def _weights_loaded(self) -> None:
        """Every server holds the new weights: those waiting since :meth:`resume_memory`
        generate again (``/continue_generation``). The SGLang senders call it inside the sync."""
        self._memory.after_sync()

    @property
    def memory_state(self) -> str:
        """``resident``, ``releasing``, ``released``, ``resuming`` (weights not synced since the
        resume) or ``unknown`` (see :mod:`~ar_torchrl.backends.sglang.memory`)."""
        return self._memory.state

    def release_memory(
        self,
        tags: Sequence[str] | None = None,
        *,
        probe: Probe | None | Literal["auto"] = "auto",
        expect_freed_bytes: int | None = None,
        timeout_s: float = 120.0,
    ) -> dict[str, float]:
        """Release the colocated servers' memory (``tags``: ``weights``, ``kv_cache``,
        ``cuda_graph``; default all) and return once the device shows it free (the barrier before
        the trainer allocates); idempotent. See
        :meth:`~ar_torchrl.backends.sglang.memory.MemoryLifecycle.release`.

        Raises:
            SGLangMemoryError: a server refuses (``device: cpu``, memory saver off) or fails.
        """
        return self._memory.release(
            tags, probe=probe, expect_freed_bytes=expect_freed_bytes, timeout_s=timeout_s
        )

    def resume_memory(self) -> dict[str, float]:
        """Take the released memory back and flush each server's cache; the next
        :meth:`sync_weights` lets the servers generate again. Idempotent."""
        return self._memory.resume()

    def close(self) -> None:
        """Release the sender, the thread pools and the HTTP session. Idempotent."""
        super().close()
        if self._memory.state != "resident":
            logger.warning(
                "SGLangBackend closed while the servers' memory is %s: they stay paused",
                self._memory.state,
            )
        with self._watch_lock:
            for server in self._servers.values():
                if server.probe is not None:
                    server.probe.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._probes.shutdown(wait=False, cancel_futures=True)
        self._aborts.shutdown(wait=False, cancel_futures=True)
        self._http.close()


def _unsent(prompt_index: int, rid: str | None) -> Completion:
    """A request an interruption kept home: no tokens, ``finish_reason="abort"``."""
    return Completion(
        prompt_index,
        [],
        [],
        "abort",
        meta={
            "finish_reason": {"type": "abort", "message": "not sent: a weight sync interrupted"},
            "id": rid,
            "server_weight_version": None,
            "interrupted": True,
            "unsent": True,
        },
    )


class _Aborter:
    """Aborts the requests of an interrupted ``_run`` (see the module docstring): by ``rid`` at
    once and again every ``ABORT_REPEAT_S``; after ``abort_all_after_s``, ``abort_all`` on the
    servers still holding some. One round at a time, on the backend's abort thread."""

    def __init__(self, backend: SGLangBackend) -> None:
        self.backend, self.start = backend, time.monotonic()
        self.last = -math.inf
        self.round: Future | None = None
        self.warned = False
        self.closed = threading.Event()

    def close(self) -> None:
        """Send nothing more, and wait for the call on the wire (an ``abort_all`` arriving after
        the sync would end the requests that continue the completions)."""
        self.closed.set()
        if self.round is not None:
            wait([self.round])

    def tick(self, pending: list[_Job]) -> None:
        now = time.monotonic()
        if (self.round is not None and not self.round.done()) or now - self.last < ABORT_REPEAT_S:
            return
        self.last = now
        targets = [(job.rid, self.backend._abort_targets(job)) for job in pending]
        for job in pending:
            job.aborted = True
        escalate = now - self.start >= self.backend.abort_all_after_s
        self.round = self.backend._aborts.submit(self._round, targets, escalate)

    def _round(self, targets: list[tuple[str, list[str]]], escalate: bool) -> None:
        b = self.backend
        servers = sorted({url for _, urls in targets for url in urls})
        if escalate and not self.warned:
            self.warned = True
            logger.warning(
                "SGLang: %d request(s) still run %.1f s after their abort (an abort that reached "
                "the scheduler before its request is lost); abort_all on %s (other clients' "
                "requests there end too)",
                len(targets),
                time.monotonic() - self.start,
                servers,
            )
        calls = [(url, {"abort_all": True}) for url in servers] if escalate else []
        calls += [(url, {"rid": rid}) for rid, urls in targets for url in urls]
        for url, body in calls:
            if self.closed.is_set():
                return
            try:
                b.post(url, "/abort_request", body, timeout_s=10.0, retry=False, decode=False)
            except SGLangError as err:  # the request then finishes on its own
                logger.warning("SGLang %s/abort_request %s failed: %s", url, body, err)
            b._count(abort_requests=1)


def _check_urls(urls: str | Sequence[str], what: str = "urls") -> list[str]:
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise ValueError(f"SGLangBackend: `{what}` is empty; pass at least one server URL")
    bad = [u for u in urls if not isinstance(u, str) or not u.startswith(("http://", "https://"))]
    if bad:
        label = "URLs" if what == "urls" else what
        raise ValueError(f"SGLangBackend: {label} must start with http:// or https://, got {bad}")
    if len(set(urls)) != len(urls):
        raise ValueError(f"SGLangBackend: a server is listed twice in {urls}")
    return [u.rstrip("/") for u in urls]


def _client_options(options: SGLangClientOptions | None, keywords: dict[str, Any]):
    """``options`` with the 0.1 keyword arguments (deprecated) applied on top."""
    options = options if options is not None else SGLangClientOptions()
    if not keywords:
        return options
    known = {f.name for f in dataclasses.fields(SGLangClientOptions)}
    unknown = sorted(set(keywords) - known)
    if unknown:
        raise TypeError(
            f"SGLangBackend() got unexpected keyword argument(s) {unknown}{closest(unknown[0], known)}"
        )
    shown = ", ".join(f"{k}={v!r}" for k, v in keywords.items())
    warnings.warn(
        f"SGLangBackend({shown}) is deprecated (removed in ar_torchrl 0.2): pass "
        f"options=SGLangClientOptions({shown}) (ar_torchrl.backends.sglang.SGLangClientOptions)",
        DeprecationWarning,
        stacklevel=3,
    )
    return dataclasses.replace(options, **keywords)
