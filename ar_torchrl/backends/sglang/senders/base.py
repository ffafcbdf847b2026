"""What the SGLang senders share: the client they talk through, per-server fan-out, version checks.

A sender is given a *client* (the ``SGLangBackend`` satisfies :class:`SGLangClient`; a sender never
imports it): its server URLs and JSON ``post``/``get`` with retries. Every request that changes
weights goes to every server **in parallel** (:func:`on_each_server`); a failure on any server
raises :class:`WeightSyncError` naming it. The last update call of a sync flushes each server's
cache itself (``"flush_cache": true``, SGLang's update endpoints' own flag: its radix cache would
otherwise keep KV computed with the old weights; :func:`post_update`), so no separate ``POST
/flush_cache`` round trip follows; a server that refuses that flush (requests of another client
still running: SGLang then fails the call but keeps the new weights) is flushed with ``POST
/flush_cache?timeout=...`` once idle. Then every server must report ``weight_version ==
str(version)`` in ``GET /model_info``; then, still inside the sync, the client's optional
``_weights_loaded()`` runs (the backend lets servers that resumed their released memory generate
again).

Shapes: SGLang 0.5.23 does not survive a wrong-shaped update (its rollback re-reads the same bad
files and the scheduler dies), so the senders refuse tensors whose shapes differ from the served
checkpoint's (:func:`check_shapes`) before sending them.
"""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from ar_torchrl.weight_sync.base import NamedTensors
from ar_torchrl.weight_sync.errors import WeightSyncError

__all__ = [
    "SGLangClient",
    "SGLangSender",
    "check_shapes",
    "checkpoint_shapes",
    "flush_caches",
    "on_each_server",
    "post_checked",
    "post_update",
    "weight_update_session",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: How long ``/flush_cache`` waits for a server to become idle (requests of other clients) (s).
FLUSH_TIMEOUT_S = 30.0


class SGLangClient(Protocol):
    """What a sender needs from the backend: URLs, API key, and JSON ``post``/``get`` with retries."""

    urls: list[str]
    api_key: str | None

    def post(
        self,
        url: str,
        path: str,
        body: Any,
        *,
        timeout_s: float | None = None,
        retry: bool = True,
        decode: bool = True,
    ) -> Any: ...

    def get(self, url: str, path: str, *, timeout_s: float = 30.0) -> Any: ...


def on_each_server(urls: Sequence[str], fn: Callable[[str], T], what: str) -> list[T]:
    """Run ``fn(url)`` for every server in parallel; raise one error naming every failed server.

    Raises:
        WeightSyncError: ``partial=True`` when some servers succeeded (they hold the update).

    Example:
        >>> on_each_server(["http://a", "http://b"], lambda url: url[-1], "ping")
        ['a', 'b']
    """
    with ThreadPoolExecutor(
        max_workers=max(1, len(urls)), thread_name_prefix="sglang-sync"
    ) as pool:
        futures = [pool.submit(fn, url) for url in urls]
        errors = [(url, f.exception()) for url, f in zip(urls, futures)]
    failed = [(url, err) for url, err in errors if err is not None]
    if failed:
        detail = "; ".join(f"{url}: {err}" for url, err in failed[:4])
        raise WeightSyncError(
            f"SGLang {what} failed on {len(failed)} of {len(urls)} server(s): {detail}",
            partial=len(failed) < len(urls) or any(getattr(e, "partial", False) for _, e in failed),
        ) from failed[0][1]
    return [f.result() for f in futures]


def post_checked(client: SGLangClient, url: str, path: str, body: dict, **kw: Any) -> Any:
    """POST and turn SGLang's ``{"success": false, "message": ...}`` into :class:`WeightSyncError`."""
    answer = client.post(url, path, body, **kw)
    if isinstance(answer, dict) and answer.get("success") is False:
        raise WeightSyncError(f"SGLang {url}{path} failed: {answer.get('message')}")
    return answer


#: SGLang 0.5.23's message when an update loaded the weights but its flush was refused
NOT_FLUSHED = "the cache was not flushed"


def post_update(client: SGLangClient, url: str, path: str, body: dict, **kw: Any) -> Any:
    """POST a weight update (:func:`post_checked`); with ``"flush_cache": true`` the server flushes
    its cache in the same call. SGLang refuses that flush while requests run (another client's)
    and fails the call, the weights loaded and versioned; then the flush is retried with
    ``POST /flush_cache?timeout=...``, which waits for the server to become idle.

    Raises:
        WeightSyncError: the update failed, or the server did not flush within the timeout.
    """
    try:
        return post_checked(client, url, path, body, **kw)
    except Exception as exc:
        if not body.get("flush_cache") or NOT_FLUSHED not in str(exc):
            raise
        logger.warning(
            "SGLang %s%s: the update's flush was refused (busy); flushing once idle", url, path
        )
    try:
        client.post(
            url, f"/flush_cache?timeout={FLUSH_TIMEOUT_S:g}", None, retry=False, decode=False
        )
    except Exception as exc:
        raise WeightSyncError(
            f"SGLang {url}: loaded the weights but did not flush its cache (busy for more than "
            f"{FLUSH_TIMEOUT_S:g} s): {exc}",
            partial=True,
        ) from exc
    return None


def flush_caches(client: SGLangClient, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Flush every server's cache (``POST /flush_cache?timeout=...``, in parallel).

    SGLang flushes only once the server is idle; it waits up to ``timeout_s`` for that (the
    requests of other clients) and answers 400 otherwise.

    Raises:
        WeightSyncError: naming every server that did not flush.
    """
    path = f"/flush_cache?timeout={timeout_s:g}"
    on_each_server(
        client.urls, lambda u: client.post(u, path, None, retry=False, decode=False), "flush_cache"
    )


def _session_call(client: SGLangClient, url: str, path: str) -> None:
    try:
        post_checked(client, url, path, {})
    except Exception as exc:
        if getattr(exc, "status", None) == 404:  # an older server: no session needed
            logger.debug("SGLang %s%s: 404, server without weight-update sessions", url, path)
            return
        raise


@contextlib.contextmanager
def weight_update_session(client: SGLangClient) -> Iterator[None]:
    """``/begin_weight_update`` on every server, ``/end_weight_update`` after (404: no session).

    When the body fails, the sessions are still ended, without hiding the original error.
    """

    def call(path: str) -> None:
        on_each_server(client.urls, lambda u: _session_call(client, u, path), path.strip("/"))

    try:
        call("/begin_weight_update")
        yield
    except BaseException:  # also a begin that failed on one server: close the others' sessions
        with contextlib.suppress(Exception):
            call("/end_weight_update")
        raise
    call("/end_weight_update")


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of the safetensors files in ``model_dir`` (headers only; ``{}`` if none).

    Example:
        >>> checkpoint_shapes(Path("/nonexistent"))
        {}
    """
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            shapes.update({k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()})
    return shapes


def check_shapes(items: Iterable[tuple[str, torch.Tensor]], shapes: dict, where: object) -> None:
    """Refuse tensors whose shapes differ from the served checkpoint's (``shapes``) before sending.

    Names absent from the checkpoint (e.g. a tied ``lm_head.weight``) are not checked; the server
    ignores unknown names.

    Raises:
        WeightSyncError: naming the first mismatching tensors.

    Example:
        >>> check_shapes([("w", torch.ones(2))], {"w": (3,)}, "ckpt")
        Traceback (most recent call last):
        ...
        ar_torchrl.weight_sync.errors.WeightSyncError: SGLang weight sync: shapes differ from the served checkpoint ckpt for 1 tensors, e.g. (name, sent, served) [('w', (2,), (3,))]; send the same architecture
    """
    bad = [
        (n, tuple(t.shape), shapes[n])
        for n, t in items
        if n in shapes and tuple(t.shape) != shapes[n]
    ]
    if bad:
        raise WeightSyncError(
            f"SGLang weight sync: shapes differ from the served checkpoint {where} for "
            f"{len(bad)} tensors, e.g. (name, sent, served) {bad[:3]}; send the same architecture"
        )


_NOT_A_SERVER = (
    "; a 404 on a weight route: is that URL an sglang-router? It has no weight-update route: give "
    "it as the router (SGLangBackend(router_url=...), backend.router=<url>) and its workers are "
    "synced directly"
)


class SGLangSender(abc.ABC):
    """Base of the SGLang senders: wrap failures, track partial updates, then check every version.

    Subclasses implement :meth:`_send` and call :meth:`_applied` once any server may have loaded
    part of the update (a later failure is then ``partial``).

    Example:
        >>> from ar_torchrl.backends.sglang.senders.disk import DiskWeightSender
        >>> isinstance(DiskWeightSender(client=None, config_dir="/tmp"), SGLangSender)
        True
    """

    name = "base"

    def __init__(self, client: SGLangClient) -> None:
        self.client = client
        self._partial = False

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Ship the tensors to every server and tag them ``version``; ``WeightSyncError`` on failure."""
        self._partial = False
        try:
            self._send(named_tensors, str(int(version)))  # the last update flushes the cache
            self._check_versions(str(int(version)))
            loaded = getattr(self.client, "_weights_loaded", None)
            if loaded is not None:  # SGLangBackend: paused servers (memory resumed) continue
                loaded()
        except WeightSyncError as err:
            err.partial = err.partial or self._partial
            if "(HTTP 404)" in str(err):
                err.args = (f"{err}{_NOT_A_SERVER}",)
            raise
        except Exception as exc:  # the client's own errors carry the server's message
            ours = type(exc).__module__.startswith("ar_torchrl.")
            hint = _NOT_A_SERVER if getattr(exc, "status", None) == 404 else ""
            raise WeightSyncError(f"{self.name} sync: {exc}{hint}", partial=self._partial) from (
                None if ours else exc
            )
        logger.info(
            "SGLang %s weight sync to %d server(s): version %s",
            self.name,
            len(self.client.urls),
            version,
        )

    def _applied(self) -> None:
        self._partial = True

    @abc.abstractmethod
    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None: ...

    def _check_versions(self, version: str) -> None:
        got = on_each_server(
            self.client.urls,
            lambda u: self.client.get(u, "/model_info").get("weight_version"),
            "version check",
        )
        wrong = [(u, g) for u, g in zip(self.client.urls, got) if g != version]
        if wrong:
            raise WeightSyncError(
                f"SGLang: after a {self.name} sync the server(s) report weight_version "
                f"{[g for _, g in wrong]} ({[u for u, _ in wrong]}), expected {version!r}",
                partial=True,
            )

    def served_shapes(self) -> list[tuple[Path, dict]]:
        """Each server's model path and the tensor shapes of its checkpoint (same filesystem)."""

        def one(url: str) -> tuple[Path, dict]:
            path = Path(self.client.get(url, "/model_info")["model_path"])
            return path, checkpoint_shapes(path)

        return on_each_server(self.client.urls, one, "model_info")

    @staticmethod
    def check_bucket(bucket: NamedTensors, served: list[tuple[Path, dict]]) -> None:
        """Check one bucket against every server's served shapes."""
        for path, shapes in served:
            check_shapes(bucket, shapes, path)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (process groups). Idempotent."""
