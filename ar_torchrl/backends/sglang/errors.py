"""Errors of the SGLang client and launcher (all :class:`SGLangError`)."""

from __future__ import annotations

__all__ = [
    "SGLangAbortError",
    "SGLangError",
    "SGLangLaunchError",
    "SGLangMemoryError",
    "SGLangRequestError",
    "SGLangResponseError",
    "SGLangTimeoutError",
    "SGLangUnavailableError",
]


class SGLangError(RuntimeError):
    """Base class of the SGLang client's errors."""


class SGLangRequestError(SGLangError):
    """The server rejected a request (HTTP 4xx); ``status`` and ``server_message`` say why.

    Example:
        >>> SGLangRequestError("rejected", status=400, server_message="unknown field").status
        400
    """

    def __init__(self, message: str, *, status: int, server_message: str) -> None:
        super().__init__(message)
        self.status = status
        self.server_message = server_message


class SGLangUnavailableError(SGLangError):
    """No answer after all retries (connection refused/dropped, or HTTP 5xx)."""


class SGLangTimeoutError(SGLangError):
    """A request got no complete answer within its deadline (not retried: the server may be busy)."""


class SGLangResponseError(SGLangError):
    """The answer breaks the protocol (malformed, too large, counts disagree, ...); never truncated."""


class SGLangAbortError(SGLangResponseError):
    """The server aborted one or more completions (counted in ``SGLangBackend.stats["aborted"]``)."""


class SGLangLaunchError(SGLangError):
    """The server process did not become healthy; the message ends with the tail of its log."""


class SGLangMemoryError(SGLangError):
    """A colocated server's memory could not be released or resumed, or generation was asked
    while it is released (see :mod:`ar_torchrl.backends.sglang.memory`).

    Example:
        >>> issubclass(SGLangMemoryError, SGLangError)
        True
    """
