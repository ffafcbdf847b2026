"""SGLang rollout backend: an HTTP client for SGLang 0.5.x servers, and a server launcher.

Modules: :mod:`.errors`, :mod:`.http` (retries, deadline, body limit, API key), :mod:`.protocol`
(request bodies, answers checked field by field), :mod:`.schema` (SGLang's own msgspec schema, for
the test double), :mod:`.client` (:class:`SGLangBackend`), :mod:`.launcher`
(:func:`launch_sglang_server`). The server runs in its own environment (``.venv-sglang``, made by
``bash scripts/setup_sglang_env.sh``).
"""

from ar_torchrl.backends.sglang.client import SGLangBackend
from ar_torchrl.backends.sglang.errors import (
    SGLangAbortError,
    SGLangError,
    SGLangLaunchError,
    SGLangRequestError,
    SGLangResponseError,
    SGLangTimeoutError,
    SGLangUnavailableError,
)
from ar_torchrl.backends.sglang.launcher import (
    API_KEY_ENV,
    CPU_SERVER_ARGS,
    SGLangServer,
    free_port,
    launch_sglang_server,
)

__all__ = [
    "API_KEY_ENV",
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
    "free_port",
    "launch_sglang_server",
]
