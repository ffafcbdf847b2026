"""JSON over HTTP for the SGLang client: retries, a whole-request deadline, a body limit, an API key.

- **Retries**: connection errors and HTTP 5xx are retried with exponential backoff, each attempt on
  the next URL of the list (failover); a 4xx raises :class:`SGLangRequestError` with the server's
  message at once. When every attempt failed to connect, one short
  :class:`SGLangUnavailableError` says that the server is not reachable. A request that must not
  reach the server twice (``idempotent=False``, e.g. SGLang's ``/release_memory_occupation``,
  whose repetition kills the server) is retried only when it certainly never arrived: the
  connection could not be opened, or HTTP 502/503/504 (nothing processed it). A connection lost
  after the request went out raises at once, saying that the server may have applied it.
- **Deadline**: ``timeout_s`` bounds the whole answer, headers *and* body: before each read of the
  body the socket timeout is set to the time left, so an answer dripped byte by byte still ends
  at the deadline (:class:`SGLangTimeoutError`, not retried).
- **Body limit**: an answer larger than ``max_response_bytes`` is refused
  (:class:`SGLangResponseError`), by its ``Content-Length`` or while it is read.
- **API key**: every request carries ``Authorization: Bearer <api_key>`` (SGLang's ``--api-key``).
- **Cancellation**: a request given a :class:`Flight` can be cancelled from another thread
  (:meth:`Flight.cancel`): its socket is shut down, so the thread waiting on the answer wakes at
  once with :class:`RequestCancelled` (not retried), and SGLang drops the request of a client that
  went away. The flight also says which server the request is on and since when (the client's
  stall detection reads it).
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import requests
import urllib3

from ar_torchrl.backends.sglang.errors import (
    SGLangError,
    SGLangRequestError,
    SGLangResponseError,
    SGLangTimeoutError,
    SGLangUnavailableError,
)

__all__ = ["Flight", "HttpClient", "RequestCancelled", "RetryPolicy", "server_error_message"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESPONSE_BYTES = 64 << 20
_CHUNK = 1 << 16


class _ConnectionFailed(Exception):
    """No (complete) answer: connection refused, reset or dropped mid-answer."""


class _NotConnected(_ConnectionFailed):
    """The connection could not be opened (refused, connect timeout): the request never left."""


#: HTTP statuses of a request nothing processed (a proxy's or an overloaded server's refusal).
_UNPROCESSED = frozenset({502, 503, 504})


class RequestCancelled(SGLangError):
    """The request's :class:`Flight` was cancelled (e.g. moved off a stalled server); not retried."""


class Flight:
    """One request in flight: the server it is on (``url``, ``None`` until sent) and since when
    (``since``, ``time.monotonic()``); both are set again at each retry.

    :meth:`cancel` may be called from any thread: the request's socket is shut down, so the
    thread waiting on the answer wakes at once and the request raises :class:`RequestCancelled`.
    A flight is used for one request.

    Example:
        >>> flight = Flight()
        >>> flight.cancel()
        >>> client = HttpClient()
        >>> client.request("GET", ["http://127.0.0.1:9"], "/health", timeout_s=1, flight=flight)
        Traceback (most recent call last):
        ...
        ar_torchrl.backends.sglang.http.RequestCancelled: SGLang GET http://127.0.0.1:9/health was cancelled
    """

    def __init__(self) -> None:
        self.url: str | None = None
        self.since = time.monotonic()
        self.cancelled = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _attempt(self, url: str) -> None:
        with self._lock:
            self.url, self.since = url, time.monotonic()

    def _attach(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            if self.cancelled:
                _shutdown(sock)

    def _detach(self) -> None:
        with self._lock:
            self._sock = None

    def cancel(self) -> None:
        """Abort the request (idempotent); its thread raises :class:`RequestCancelled`."""
        with self._lock:
            self.cancelled = True
            _shutdown(self._sock)


def _shutdown(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass


_current = threading.local()  # the Flight of the request this thread is sending


class _Attach:
    """Hands the connection's socket to the current thread's :class:`Flight` before it blocks on
    the answer (the only moment the socket is known before the headers are back)."""

    def getresponse(self, *args: Any, **kwargs: Any) -> Any:
        flight = getattr(_current, "flight", None)
        if flight is not None:
            flight._attach(self.sock)
        return super().getresponse(*args, **kwargs)


class _HTTPConnection(_Attach, urllib3.connection.HTTPConnection):
    pass


class _HTTPSConnection(_Attach, urllib3.connection.HTTPSConnection):
    pass


class _HTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


class _Adapter(requests.adapters.HTTPAdapter):
    """requests' adapter whose connections report their socket to a :class:`Flight`."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}


def server_error_message(data: bytes) -> str:
    """Extract SGLang's error text from an error body (its three JSON shapes, or raw text).

    Example:
        >>> server_error_message(b'{"error": "unknown field `max_tokens`"}')
        'unknown field `max_tokens`'
        >>> server_error_message(b'{"error": {"message": "too long"}}')
        'too long'
    """
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return data.decode(errors="replace").strip()[:2000]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))[:2000]
        if isinstance(err, str):
            return err[:2000]
        return str(body.get("message", body))[:2000]
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


def _short(exc: BaseException) -> str:
    """``[Errno 111] Connection refused`` out of requests' nested connection errors."""
    found = re.search(r"\[Errno -?\d+\] [^'\")]+", str(exc))
    return found.group(0).strip() if found else f"{type(exc).__name__}: {str(exc)[:200]}"


class HttpClient:
    """JSON requests to SGLang servers (see the module docstring); counts retries in ``stats``.

    Args:
        api_key: sent as ``Authorization: Bearer <api_key>`` (``None``: no header).
        connect_timeout_s: TCP connect timeout.
        retry: the retry policy.
        max_response_bytes: largest answer accepted.
        pool_size: kept-alive connections per host.

    Example:
        >>> client = HttpClient(retry=RetryPolicy(max_retries=0), connect_timeout_s=0.5)
        >>> client.request("GET", ["http://127.0.0.1:9"], "/health", timeout_s=1)
        Traceback (most recent call last):
        ...
        ar_torchrl.backends.sglang.errors.SGLangUnavailableError: the SGLang server at http://127.0.0.1:9 is not reachable ([Errno 111] Connection refused, 1 attempt(s)); is it running, and is the URL right?
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        connect_timeout_s: float = 5.0,
        retry: RetryPolicy | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        pool_size: int = 10,
    ) -> None:
        self.session = requests.Session()
        adapter = _Adapter(pool_connections=pool_size, pool_maxsize=pool_size)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.connect_timeout_s, self.max_response_bytes = connect_timeout_s, max_response_bytes
        self.retry = retry or RetryPolicy()
        self.stats = {"retries": 0}
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
        flight: Flight | None = None,
        decode: bool = True,
        idempotent: bool = True,
    ) -> Any:
        """Send ``body`` to ``urls[0] + path``; retries go to the next URL in ``urls`` (failover).

        ``flight``, if given, follows the request (its server, since when) and can cancel it.
        ``idempotent=False``: retried only when it certainly never reached a server (see the
        module docstring).

        Returns:
            The decoded JSON answer (``None`` for an empty 2xx body); with ``decode=False`` the
            answer's text (SGLang answers some routes, e.g. ``/flush_cache``, in plain text).

        Raises:
            RequestCancelled: ``flight`` was cancelled.
        """
        attempts = self.retry.max_retries + 1 if retry else 1
        failures: list[str] = []
        for attempt in range(attempts):
            if attempt:
                with self._lock:
                    self.stats["retries"] += 1
                time.sleep(self.retry.delay(attempt - 1))
            url = urls[attempt % len(urls)]
            try:
                status, data = self._exchange(method, url, path, body, timeout_s, flight)
            except _ConnectionFailed as exc:
                failures.append(f"connection error: {exc}")
                if not idempotent and not isinstance(exc, _NotConnected):
                    raise _maybe_applied(url + path, str(exc)) from None
            else:
                if status < 500:
                    return _decode(status, data, url + path, json_answer=decode)
                failures.append(f"HTTP {status}: {server_error_message(data)}")
                if not idempotent and status not in _UNPROCESSED:
                    raise _maybe_applied(url + path, failures[-1]) from None
            logger.warning(
                "SGLang %s%s attempt %d/%d: %s", url, path, attempt + 1, attempts, failures[-1]
            )
        raise _unavailable(urls, path, failures)

    def probe(self, url: str, path: str, *, timeout_s: float, flight: Flight | None = None) -> bool:
        """``True`` when ``GET url + path`` answers 2xx within ``timeout_s`` (one attempt, no log).

        Example:
            >>> HttpClient(connect_timeout_s=0.5).probe("http://127.0.0.1:9", "/health", timeout_s=1)
            False
        """
        try:
            status, _ = self._exchange("GET", url, path, None, timeout_s, flight)
        except (SGLangError, _ConnectionFailed):
            return False
        return 200 <= status < 300

    def _exchange(
        self,
        method: str,
        url: str,
        path: str,
        body: Any,
        timeout_s: float,
        flight: Flight | None,
    ) -> tuple[int, bytes]:
        if flight is None:
            return self._send(method, url + path, body, timeout_s)
        if flight.cancelled:
            raise RequestCancelled(f"SGLang {method} {url}{path} was cancelled")
        flight._attempt(url)
        _current.flight = flight
        try:
            return self._send(method, url + path, body, timeout_s, flight)
        except (SGLangError, _ConnectionFailed):
            if flight.cancelled:  # the shut-down socket, not the server
                raise RequestCancelled(f"SGLang {method} {url}{path} was cancelled") from None
            raise
        finally:
            _current.flight = None
            flight._detach()

    def _send(
        self, method: str, url: str, body: Any, timeout_s: float, flight: Flight | None = None
    ) -> tuple[int, bytes]:
        deadline = time.monotonic() + timeout_s
        try:
            response = self.session.request(
                method, url, json=body, timeout=(self.connect_timeout_s, timeout_s), stream=True
            )
        except requests.exceptions.ReadTimeout as exc:
            raise _timeout(url, timeout_s) from exc
        except requests.exceptions.ConnectionError as exc:
            if _never_connected(exc):
                raise _NotConnected(_short(exc)) from None
            raise _ConnectionFailed(_short(exc)) from None
        with response:
            try:
                return response.status_code, self._read(response, deadline, url, timeout_s)
            finally:  # before the connection goes back to the pool (and to another request)
                if flight is not None:
                    flight._detach()

    def _read(
        self, response: requests.Response, deadline: float, url: str, timeout_s: float
    ) -> bytes:
        limit = self.max_response_bytes
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(url, f"{declared} bytes (Content-Length)", limit)
        chunks, size = [], 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timeout(url, timeout_s)
            sock = getattr(response.raw.connection, "sock", None)
            if sock is not None:
                sock.settimeout(left)
            try:
                chunk = response.raw.read1(_CHUNK, decode_content=True)
            except urllib3.exceptions.ReadTimeoutError as exc:
                raise _timeout(url, timeout_s) from exc
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise _ConnectionFailed(f"answer cut off ({_short(exc)})") from None
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > limit:
                raise _too_large(url, f"more than {size} bytes", limit)
            chunks.append(chunk)

    def close(self) -> None:
        self.session.close()


def _decode(status: int, data: bytes, where: str, json_answer: bool = True) -> Any:
    if status >= 400:
        message = server_error_message(data)
        hint = (
            "; the server requires an API key: pass api_key= (or set AR_TORCHRL_SGLANG_API_KEY)"
            if status == 401
            else ""
        )
        raise SGLangRequestError(
            f"SGLang {where} rejected the request (HTTP {status}): {message}{hint}",
            status=status,
            server_message=message,
        )
    if not json_answer:
        return data.decode(errors="replace")
    if not data:
        return None
    try:
        return json.loads(data)
    except RecursionError:
        raise SGLangResponseError(
            f"SGLang {where}: answer nests too deeply to be a protocol answer"
        ) from None
    except ValueError:
        raise SGLangResponseError(f"SGLang {where}: answer is not JSON: {data[:300]!r}") from None


def _never_connected(exc: requests.exceptions.ConnectionError) -> bool:
    """The connection was never opened (nothing was sent): refused, unreachable, connect timeout."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return True
    reason = getattr(exc.args[0] if exc.args else None, "reason", None)
    return isinstance(
        reason, (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError)
    )


def _maybe_applied(where: str, failure: str) -> SGLangUnavailableError:
    err = SGLangUnavailableError(
        f"SGLang {where}: {failure} after the request was sent; the server may have applied it, "
        "so it is not sent again (repeating it could break the server): check the server's log "
        "and its state before retrying"
    )
    err.maybe_applied = True  # (read by the memory lifecycle: the server's state is unknown)
    return err


def _timeout(url: str, timeout_s: float) -> SGLangTimeoutError:
    return SGLangTimeoutError(
        f"SGLang {url}: no complete answer within timeout_s={timeout_s}s; raise the backend's "
        "`timeout_s` (the recipe's backend.timeout_s; backend.sync_timeout_s for weight syncs) "
        "for long generations, or check the server log"
    )


def _too_large(url: str, got: str, limit: int) -> SGLangResponseError:
    return SGLangResponseError(
        f"SGLang {url}: answer of {got} exceeds max_response_bytes={limit}; raise the backend's "
        "`max_response_bytes` if such answers are expected"
    )


def _unavailable(urls: Sequence[str], path: str, failures: list[str]) -> SGLangUnavailableError:
    if all(f.startswith("connection error:") and "cut off" not in f for f in failures):
        where = urls[0] if len(set(urls)) == 1 else list(dict.fromkeys(urls))
        reason = failures[-1].removeprefix("connection error: ")
        return SGLangUnavailableError(
            f"the SGLang server at {where} is not reachable ({reason}, {len(failures)} attempt(s)); "
            "is it running, and is the URL right?"
        )
    return SGLangUnavailableError(
        f"SGLang {path}: no successful answer after {len(failures)} attempt(s) to "
        f"{list(dict.fromkeys(urls))}; last failure: {failures[-1]}"
    )
