"""The colocated SGLang server's memory lifecycle: released while the trainer updates, resumed after.

A colocated server shares its GPU with the trainer. Around each PPO update its memory (weights, KV
cache, CUDA graphs) is released and resumed through SGLang 0.5.23's HTTP API. Each server goes
through these states (:attr:`MemoryLifecycle.states`); :attr:`MemoryLifecycle.state` is the
backend's as a whole::

    resident --release()--> paused --> released --resume()--> resumed --> flushed --sync--> resident
    \\_______ "releasing" ________/  "released"  \\_____ "resuming" (weights not synced) ____/

- :meth:`MemoryLifecycle.release`: ``POST /pause_generation {"mode": "abort"}`` (SGLang asserts
  that its scheduler is idle when it releases, and a failed assertion ends the server: the pause
  aborts what other clients still run and holds new requests until ``/continue_generation``), then
  ``POST /release_memory_occupation {"tags": [...]}``, then a **barrier**: the call may answer
  before the memory is free (slime #579, sglang #14092) and SGLang reports no memory state over
  HTTP, so the trainer's own device is watched (``torch.cuda.mem_get_info``, or a ``probe``) until
  it shows at least half of what the server reported holding for those tags (``GET /v1/loads``:
  ``memory.weight_gb``, ``kv_cache_gb``, ``graph_gb``; the smallest server's) freed, and its free
  memory stopped growing. Only then may the trainer allocate.
- :meth:`MemoryLifecycle.resume`: ``POST /resume_memory_occupation`` with the released tags, then
  ``POST /flush_cache`` (the radix tree would point into memory that was handed back).
- The next weight sync loads the weights (SGLang accepts updates while paused) and then
  ``POST /continue_generation`` (:meth:`MemoryLifecycle.after_sync`): SGLang does not keep the
  released weights (it frees them, sglang #6367), so generation is refused from ``release()`` until
  a sync succeeded after ``resume()`` (when ``weights`` was not released, ``resume()`` continues at
  once).

**Idempotent**: each call does only what is left per server: a second ``release()`` (or one after
a failure part-way) skips the servers already released; ``resume()`` of resident servers does
nothing. SGLang itself is not idempotent here: resuming a tag it did not release, or releasing
while requests run, kills the server (``KeyError`` / ``AssertionError`` in its scheduler), which is
why every server's state is tracked. **Retries**: ``/pause_generation``, ``/continue_generation`` and
``/flush_cache`` are retried with backoff (connection errors, 5xx); the release and resume calls
only when they certainly never reached the server (connection not opened, HTTP 502/503/504). A
server whose answer was lost after the request went out is in state ``"unknown"``: nothing more is
sent to it, and the error says to check (or restart) it.

**Refused**: a server that reports ``device: "cpu"`` (SGLang 0.5.23's CPU server dies on
``/release_memory_occupation``: its scheduler calls ``torch.cuda.synchronize()`` and raises
``RuntimeError: Found no NVIDIA driver on your system``), or ``enable_memory_saver: false``
(``/release_memory_occupation`` then frees nothing): :class:`SGLangMemoryError` names the server
and the fix, and nothing is sent.

In the recipe (``backend.release_memory_during_update=true``, ``train.mode=sync``) the loop calls
``SGLangBackend.release_memory()`` before the update (every rank waits for it) and
``resume_memory()`` after it; the weight push that follows lets the servers generate again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Protocol

from ar_torchrl.backends.sglang.errors import SGLangError, SGLangMemoryError, SGLangTimeoutError
from ar_torchrl.weight_sync.errors import WeightSyncError

__all__ = [
    "MEMORY_TAGS",
    "MemoryLifecycle",
    "cuda_free_bytes",
    "wait_until_freed",
]

logger = logging.getLogger(__name__)

#: SGLang 0.5.23's memory tags (``GPU_MEMORY_ALL_TYPES``); no tags means all of them.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
#: what ``GET /v1/loads`` reports of each tag (``loads[0].memory``, GB)
_LOADS_KEYS = {"weights": "weight_gb", "kv_cache": "kv_cache_gb", "cuda_graph": "graph_gb"}
#: the barrier: this share of the expected bytes freed, and free memory stable this long
FREED_FRACTION = 0.5
SETTLE_S = 0.2
_STABLE_BYTES = 16 << 20  # changes below this are noise (other allocations, the driver)

ServerState = Literal["resident", "paused", "released", "resumed", "flushed", "unknown"]
State = Literal["resident", "releasing", "released", "resuming", "unknown"]
Probe = Callable[[], int]


class _Client(Protocol):
    """What the lifecycle needs of the backend (``SGLangBackend`` has it)."""

    urls: list[str]

    def post(self, url: str, path: str, body: Any, **kw: Any) -> Any: ...

    def get(self, url: str, path: str, **kw: Any) -> Any: ...

    def server_info(self) -> list[dict]: ...


def cuda_free_bytes() -> int:
    """Free bytes on the current CUDA device (``torch.cuda.mem_get_info``): the default probe of
    the barrier when the trainer sees a GPU.

    Example:
        >>> import torch
        >>> cuda_free_bytes() > 0 if torch.cuda.is_available() else True
        True
    """
    import torch

    return int(torch.cuda.mem_get_info()[0])


def wait_until_freed(
    probe: Probe,
    before: int,
    at_least: int,
    *,
    timeout_s: float,
    settle_s: float = SETTLE_S,
    poll_s: float = 0.02,
) -> int:
    """Wait until ``probe()`` (free bytes) is ``before + at_least`` or more and has not grown for
    ``settle_s``; return the bytes freed.

    Raises:
        SGLangMemoryError: not reached within ``timeout_s`` (naming what was freed).

    Example:
        >>> readings = iter([100, 300, 900, 900, 900, 900])
        >>> wait_until_freed(lambda: next(readings, 900), before=100, at_least=500, timeout_s=5,
        ...                  settle_s=0.0, poll_s=0.0)
        800
    """
    start = last_change = time.monotonic()
    last = probe()
    while True:
        now, free = time.monotonic(), probe()
        if abs(free - last) > _STABLE_BYTES:
            last, last_change = free, now
        if free - before >= at_least and now - last_change >= settle_s:
            return free - before
        if now - start > timeout_s:
            raise SGLangMemoryError(
                f"SGLang /release_memory_occupation answered, but the device freed only "
                f"{(free - before) / 2**20:.0f} MiB of the expected >= {at_least / 2**20:.0f} MiB "
                f"within {timeout_s:g} s: is the server on this GPU (its memory saver on), or does "
                "another process hold the memory? Raise timeout_s, or pass expect_freed_bytes=0 "
                "to wait for stable free memory only"
            )
        time.sleep(poll_s)


class MemoryLifecycle:
    """Per-server state of the release / resume cycle of colocated SGLang servers (see the module
    docstring); ``SGLangBackend.release_memory()`` / ``resume_memory()`` delegate here.

    Args:
        client: the backend (server URLs, ``post``/``get`` with retries, ``server_info``).
        lock: held during each step (the backend's engine lock: no generation of its own runs).
        timeout_s: deadline of each HTTP call (the release of a large model takes seconds).

    Example:
        >>> from types import SimpleNamespace
        >>> memory = MemoryLifecycle(SimpleNamespace(urls=["http://127.0.0.1:9"]))
        >>> memory.state, memory.resume()  # resident: nothing to resume
        ('resident', {})
        >>> memory.check_can_generate()
    """

    def __init__(
        self, client: _Client, lock: threading.Lock | None = None, timeout_s: float = 600.0
    ) -> None:
        self.client, self.timeout_s = client, timeout_s
        self._lock = lock or threading.Lock()
        self._states: dict[str, ServerState] = {}
        self._urls: list[str] = []  # the servers of the last step (none yet: all resident)
        self._tags: dict[str, list[str]] = {}  # what each server released
        self._why_unknown: dict[str, str] = {}
        self._barrier: tuple[Probe | None, int, int] | None = None  # (probe, free before, expected)

    # -- state ---------------------------------------------------------------------------------

    @property
    def states(self) -> dict[str, ServerState]:
        """Each server's state, as of the last step (before any: none, all resident)."""
        return {url: self._states.get(url, "resident") for url in self._urls}

    def _servers(self) -> dict[str, ServerState]:
        """The servers now (read from the router behind one) with their states."""
        self._urls = list(dict.fromkeys(self._urls + list(self.client.urls)))
        return self.states

    @property
    def state(self) -> State:
        """The backend's state: ``resident``, ``releasing`` (part-way), ``released``,
        ``resuming`` (memory back, weights not synced yet) or ``unknown`` (a server's answer was
        lost)."""
        states = set(self.states.values()) or {"resident"}
        if "unknown" in states:
            return "unknown"
        if states == {"resident"}:
            return "resident"
        if states == {"released"}:
            return "released"
        if states <= {"resumed", "flushed", "resident"}:
            return "resuming"
        return "releasing"

    def check_can_generate(self) -> None:
        """Raise :class:`SGLangMemoryError` unless every server is resident (with weights synced
        since its memory came back)."""
        state = self.state
        if state == "resident":
            return
        fix = {
            "released": "call resume_memory(), then sync_weights() (SGLang frees released weights)",
            "resuming": "call sync_weights() first: SGLang does not keep released weights, and "
            "the servers generate again once the new weights are loaded",
            "releasing": "a release stopped part-way: call release_memory() again to finish it, "
            "or resume_memory() to go back",
        }.get(state, self._unknown_hint())
        raise SGLangMemoryError(
            f"SGLangBackend: cannot generate while the servers' memory is {state} "
            f"(per server: {self.states}); {fix}"
        )

    def check_can_sync(self) -> None:
        """Raise :class:`WeightSyncError` (nothing sent) while a server's memory is released."""
        bad = {u: s for u, s in self.states.items() if s in ("released", "resumed", "unknown")}
        if bad:
            fix = (
                self._unknown_hint() if "unknown" in bad.values() else "call resume_memory() first"
            )
            raise WeightSyncError(
                f"SGLangBackend: weight sync refused: the memory of {bad} is not resident "
                f"(weights cannot load into released memory); {fix}"
            )

    # -- steps ---------------------------------------------------------------------------------

    def release(
        self,
        tags: Sequence[str] | None = None,
        *,
        probe: Probe | None | Literal["auto"] = "auto",
        expect_freed_bytes: int | None = None,
        timeout_s: float = 120.0,
    ) -> dict[str, float]:
        """Pause, release ``tags`` (default: all) on every server not released yet, then wait
        until the device shows the memory free (``probe``: free bytes; ``"auto"``: the current
        CUDA device when the trainer sees one, else no barrier). Returns the measurements
        (``release_s``, ``barrier_s``, ``freed_bytes``; ``{}`` when already released).

        Raises:
            SGLangMemoryError: a server refuses (CPU, memory saver off), fails, or the barrier
                times out; the servers already released stay released: a second call releases
                the others and waits again (from the first call's reading of the device).
        """
        tags = _check_tags(tags)
        with self._lock:
            self._check_known()
            todo = [u for u, s in self._servers().items() if s != "released"]
            out = {"release_s": 0.0, "barrier_s": 0.0, "freed_bytes": 0.0}
            if todo:
                self._check_supported(todo)
                if self._barrier is None:  # (a call after a failed one keeps the first reading)
                    probe = _resolve_probe(probe)
                    expected = (
                        0 if probe is None else self._expected_bytes(todo, tags, expect_freed_bytes)
                    )
                    self._barrier = (probe, probe() if probe is not None else 0, expected)
                start = time.monotonic()
                self._each(todo, lambda url: self._release_one(url, tags), "release")
                out["release_s"] = time.monotonic() - start
            elif self._barrier is None:
                logger.debug("SGLang memory already released on %s", self._urls)
                return {}
            probe, before, expected = self._barrier
            if probe is not None:  # also again after a barrier that timed out
                start = time.monotonic()
                freed = wait_until_freed(probe, before, expected, timeout_s=timeout_s)
                out.update(barrier_s=time.monotonic() - start, freed_bytes=float(freed))
            self._barrier = None
            logger.info(
                "SGLang memory released on %d server(s) (tags %s): %.2f s, then %.2f s until "
                "the device showed %.0f MiB free",
                len(todo),
                tags or "all",
                out["release_s"],
                out["barrier_s"],
                out["freed_bytes"] / 2**20,
            )
            return out

    def resume(self) -> dict[str, float]:
        """Resume what each server released and flush its cache; servers that released their
        weights generate again after the next successful sync (:meth:`after_sync`). Returns
        ``resume_s`` (``{}`` when nothing was released).

        Raises:
            SGLangMemoryError: a server fails (the others keep their progress; call again).
        """
        with self._lock:
            self._check_known()
            self._barrier = None  # a barrier that timed out is not waited for any more
            todo = [u for u, s in self._servers().items() if s in ("paused", "released", "resumed")]
            if not todo:
                return {}
            start = time.monotonic()
            self._each(todo, self._resume_one, "resume")
            logger.info(
                "SGLang memory resumed and cache flushed on %d server(s) in %.2f s%s",
                len(todo),
                time.monotonic() - start,
                "; they generate again after the next weight sync"
                if self.state == "resuming"
                else "",
            )
            return {"resume_s": time.monotonic() - start}

    def after_sync(self) -> None:
        """After weights were loaded: ``POST /continue_generation`` on every server that waits for
        them (called inside the sync, so that generation sees the new weights only)."""
        todo = [u for u, s in self.states.items() if s == "flushed"]
        if todo:
            self._each(todo, self._continue, "continue_generation", error=WeightSyncError)
            logger.info("SGLang servers %s generate again (weights synced after resume)", todo)

    # -- one server ----------------------------------------------------------------------------

    def _release_one(self, url: str, tags: list[str]) -> None:
        if self._states.get(url, "resident") == "resident":
            self._post(url, "/pause_generation", {"mode": "abort"})
            self._states[url] = "paused"
        self._post(url, "/release_memory_occupation", _tags_body(tags), once=True)
        self._states[url], self._tags[url] = "released", tags

    def _resume_one(self, url: str) -> None:
        state = self._states.get(url, "resident")
        if state == "paused":  # nothing was released there: it may generate at once
            self._continue(url)
            return
        if state == "released":
            self._post(url, "/resume_memory_occupation", _tags_body(self._tags[url]), once=True)
            self._states[url] = "resumed"
        self._post(url, "/flush_cache", None, decode=False)
        self._states[url] = "flushed"
        if "weights" not in (self._tags.get(url) or MEMORY_TAGS):  # weights kept: no sync needed
            self._continue(url)

    def _continue(self, url: str) -> None:
        self._post(url, "/continue_generation", {})
        self._states[url] = "resident"
        self._tags.pop(url, None)

    def _post(
        self, url: str, path: str, body: Any, *, once: bool = False, decode: bool = True
    ) -> Any:
        try:
            return self.client.post(
                url, path, body, timeout_s=self.timeout_s, idempotent=not once, decode=decode
            )
        except SGLangError as err:  # no answer to a step SGLang must not get twice: unknown
            if once and (
                getattr(err, "maybe_applied", False) or isinstance(err, SGLangTimeoutError)
            ):
                self._states[url], self._why_unknown[url] = "unknown", f"{path}: {err}"
            raise

    # -- helpers -------------------------------------------------------------------------------

    def _each(
        self, urls: list[str], fn: Callable[[str], None], what: str, error: type = SGLangMemoryError
    ) -> None:
        with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="sglang-memory") as pool:
            futures = [pool.submit(fn, url) for url in urls]
            failed = [(u, f.exception()) for u, f in zip(urls, futures) if f.exception()]
        if failed:
            detail = "; ".join(f"{u} ({self.states[u]}): {e}" for u, e in failed[:4])
            raise error(
                f"SGLang memory {what} failed on {len(failed)} of {len(urls)} server(s): {detail}; "
                f"the others went on (per server: {self.states})"
            ) from failed[0][1]

    def _check_known(self) -> None:
        if self.state == "unknown":
            raise SGLangMemoryError(
                f"SGLang memory lifecycle stopped: {self._unknown_hint()} (per server: {self.states})"
            )

    def _unknown_hint(self) -> str:
        return (
            f"the state of {sorted(self._why_unknown)} is unknown ({self._why_unknown}); nothing "
            "more is sent there: check its log (SGLang kills the server on a repeated release or "
            "resume) and restart it"
        )

    def _check_supported(self, urls: list[str]) -> None:
        infos = dict(zip(self.client.urls, self.client.server_info()))
        for url in urls:
            info = infos.get(url) or {}
            if info.get("device") == "cpu":
                raise SGLangMemoryError(
                    f"SGLang server {url} runs on device='cpu': its /release_memory_occupation "
                    "needs a GPU (SGLang 0.5.23's scheduler calls torch.cuda.synchronize() there "
                    "and dies with 'RuntimeError: Found no NVIDIA driver on your system'); "
                    "nothing was sent. Release memory only for colocated GPU servers "
                    "(backend.release_memory_during_update=false on CPU)"
                )
            if info.get("enable_memory_saver") is False:
                raise SGLangMemoryError(
                    f"SGLang server {url} runs without --enable-memory-saver: its "
                    "/release_memory_occupation would free nothing; launch it with "
                    "--enable-memory-saver (the launcher adds it when "
                    "backend.release_memory_during_update=true); nothing was sent"
                )

    def _expected_bytes(self, urls: list[str], tags: list[str], given: int | None) -> int:
        """``given``, else half of the smallest server's reported memory of ``tags``."""
        if given is not None:
            return int(given)
        held = []
        for url in urls:
            try:
                memory = self.client.get(url, "/v1/loads")["loads"][0]["memory"]
                held.append(sum(float(memory[_LOADS_KEYS[t]]) for t in tags or MEMORY_TAGS))
            except (SGLangError, KeyError, IndexError, TypeError, ValueError) as err:
                logger.warning(
                    "SGLang %s/v1/loads reports no memory (%s): the barrier waits for stable "
                    "free memory only",
                    url,
                    err,
                )
                return 0
        return int(FREED_FRACTION * max(0.0, min(held)) * 2**30)


def _check_tags(tags: Sequence[str] | None) -> list[str]:
    """The tags to send (``[]``: all).

    Example:
        >>> _check_tags(None), _check_tags(["kv_cache"])
        ([], ['kv_cache'])
        >>> _check_tags(["kv"])
        Traceback (most recent call last):
        ...
        ValueError: release_memory: unknown tags ['kv']; SGLang 0.5.23 knows ('weights', 'kv_cache', 'cuda_graph') (none: all)
    """
    tags = [] if tags is None else [str(t) for t in tags]
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(
            f"release_memory: unknown tags {unknown}; SGLang 0.5.23 knows {MEMORY_TAGS} (none: all)"
        )
    return sorted(set(tags), key=MEMORY_TAGS.index)


def _tags_body(tags: list[str]) -> dict:
    """SGLang's ``{"tags": [...]}`` (``{}``: every tag).

    Example:
        >>> _tags_body([]), _tags_body(["weights"])
        ({}, {'tags': ['weights']})
    """
    return {"tags": tags} if tags else {}


def _resolve_probe(probe: Probe | None | Literal["auto"]) -> Probe | None:
    if probe != "auto":
        return probe
    import torch

    return cuda_free_bytes if torch.cuda.is_available() else None
