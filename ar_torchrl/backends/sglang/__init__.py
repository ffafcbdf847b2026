"""SGLang rollout backend: an HTTP client for SGLang 0.5.x servers, its launcher, reaper and senders.

Modules: :mod:`.errors`, :mod:`.http` (retries, deadline, body limit, API key), :mod:`.protocol`
(request bodies, answers checked field by field), :mod:`.schema` (SGLang's own msgspec schema, for
the test double), :mod:`.client` (:class:`SGLangBackend`), :mod:`.launcher`
(:func:`launch_sglang_server`), :mod:`.router` (:func:`launch_sglang_router`: an sglang-router in
front of the servers), :mod:`.reaper` (launched servers and routers die with their owner),
:mod:`.memory` (release and resume of colocated servers' memory around each update),
:mod:`.senders` (disk / tensor / distributed weight sync), :mod:`.config` (torch-free config
schemas). The server runs in its own environment (``.venv-sglang``, made by
``bash scripts/setup_sglang_env.sh``). Names are imported on first use.
"""

from __future__ import annotations

from ar_torchrl._lazy import lazy_exports

_EXPORTS = {
    "SGLangBackend": "client",
    "SGLangClientOptions": "config",
    **dict.fromkeys(
        [
            "SGLangAbortError",
            "SGLangError",
            "SGLangLaunchError",
            "SGLangMemoryError",
            "SGLangRequestError",
            "SGLangResponseError",
            "SGLangTimeoutError",
            "SGLangUnavailableError",
        ],
        "errors",
    ),
    **dict.fromkeys(
        ["API_KEY_ENV", "CPU_SERVER_ARGS", "SGLangServer", "free_port", "launch_sglang_server"],
        "launcher",
    ),
    **dict.fromkeys(["SGLangRouter", "launch_sglang_router"], "router"),
    **dict.fromkeys(["MemoryLifecycle"], "memory"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
