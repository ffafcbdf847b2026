"""How the SGLang client talks to the servers (:class:`SGLangClientOptions`) and the checks the
client, its config schema (:mod:`ar_torchrl.backends.sglang.config`) and the senders share.

Torch-free; the client and the schema both import it (neither imports the other at module level).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from ar_torchrl.utils.checks import MAX_TIMEOUT_S, check_choice, check_number, check_timeout

# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
# ruff: noqa: UP045

__all__ = ["SGLangClientOptions", "check_stall_grace"]


def check_stall_grace(
    owner: str, value: Any, *, at_least: float | None = None, hint: str = ""
) -> Any:
    """How long a server holding requests may stay silent before they move (``None``: never):
    ``> 0`` seconds (``>= at_least`` where given: real servers answer the probe after 1 s at the
    earliest), a week at most.

    Example:
        >>> check_stall_grace("SGLangBackend", 0)
        Traceback (most recent call last):
        ...
        ValueError: SGLangBackend: stall_grace_s must be > 0, got 0 (None disables the stall detection)
    """
    hint = hint or "None disables the stall detection"
    bound = {"gt": 0} if at_least is None else {"ge": at_least}
    check_number(owner, "stall_grace_s", value, **bound, allow_none=True, hint=hint)
    return check_timeout(owner, "stall_grace_s", value, allow_none=True)


@dataclass(frozen=True)
class SGLangClientOptions:
    """How :class:`~ar_torchrl.backends.SGLangBackend` talks to the servers (everything but where
    they are and how the weights travel), checked once by :meth:`check` (the client calls it).

    Attributes:
        api_key: the servers' ``--api-key`` (``None``: ``$AR_TORCHRL_SGLANG_API_KEY``, if set).
        max_concurrency: in-flight ``/generate`` requests.
        timeout_s: deadline of one whole ``/generate`` answer (seconds).
        stall_grace_s: how long a server holding requests may stay silent (no answer, no passed
            probe) before its requests move to the other servers (``None``: never; then only
            ``timeout_s`` ends a wait). Keep it well above the probe's latency (SGLang answers
            ``/health_generate`` after 1 s at the earliest).
        sync_timeout_s: deadline of each weight-sync request.
        probe_path: the liveness probe, ``GET`` while requests wait (``"/health_generate"``: the
            scheduler made progress; ``"/health"``: only the HTTP process answers).
        connect_timeout_s: TCP connect timeout.
        max_retries, backoff_s, backoff_max_s: retry policy for connection errors and 5xx.
        max_response_bytes: largest answer accepted (``None``: the HTTP client's 64 MiB).
        on_abort: ``"raise"`` or ``"keep"`` the completions a server aborted.
        extra_sampling_params: more SGLang ``sampling_params`` (e.g. ``{"ignore_eos": True}``);
            keys are checked against SGLang's schema by the client, not at the server.
        vocab_size: token ids at or above it are a protocol error (``None``: not checked here).
        show_progress: tqdm bar over prompts (``None``: only on a terminal).
        abort_all_after_s: partial rollouts: a request still running this long after its first
            abort (whose abort SGLang lost) is ended with ``{"abort_all": true}`` on its server.

    Example:
        >>> SGLangClientOptions(timeout_s=30.0, show_progress=False).timeout_s
        30.0
        >>> SGLangClientOptions(sync_timeout_s=1e10).check()
        Traceback (most recent call last):
        ...
        ValueError: SGLangBackend: sync_timeout_s must be <= 604800 (seconds: a week), got 10000000000.0
    """

    api_key: Optional[str] = None
    max_concurrency: int = 8
    timeout_s: float = 600.0
    stall_grace_s: Optional[float] = 60.0
    sync_timeout_s: float = 600.0
    probe_path: str = "/health_generate"
    connect_timeout_s: float = 5.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    max_response_bytes: Optional[int] = None
    on_abort: str = "raise"
    extra_sampling_params: Optional[Mapping[str, Any]] = None
    vocab_size: Optional[int] = None
    show_progress: Optional[bool] = None
    abort_all_after_s: float = 5.0

    def check(self, owner: str = "SGLangBackend") -> None:
        check_number(owner, "max_concurrency", self.max_concurrency, ge=1, integer=True)
        check_choice(owner, "on_abort", self.on_abort, ("raise", "keep"))
        check_timeout(owner, "timeout_s", self.timeout_s)
        check_timeout(owner, "sync_timeout_s", self.sync_timeout_s)
        check_timeout(owner, "connect_timeout_s", self.connect_timeout_s)
        check_number(owner, "abort_all_after_s", self.abort_all_after_s, ge=0, le=MAX_TIMEOUT_S)
        check_stall_grace(owner, self.stall_grace_s)
        if not isinstance(self.probe_path, str) or not self.probe_path.startswith("/"):
            raise ValueError(f"{owner}: probe_path must start with '/', got {self.probe_path!r}")
        check_number(owner, "max_retries", self.max_retries, ge=0, integer=True)
        check_number(owner, "backoff_s", self.backoff_s, ge=0)
        check_number(owner, "backoff_max_s", self.backoff_max_s, ge=0)
        check_number(
            owner,
            "max_response_bytes",
            self.max_response_bytes,
            ge=1,
            integer=True,
            allow_none=True,
        )
        check_number(owner, "vocab_size", self.vocab_size, ge=1, integer=True, allow_none=True)
