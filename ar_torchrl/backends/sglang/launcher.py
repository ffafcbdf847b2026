"""Start a local SGLang server (its own venv, ``.venv-sglang``) that never outlives this process.

:func:`launch_sglang_server` runs ``python -m sglang.launch_server`` with its output in a log file
(SGLang's children inherit stdout, so a pipe would block) and waits for ``GET /health``. The server
dies with the process that launched it, whatever ends that process:

- the context manager stops it on exit (exceptions and Ctrl-C included), and removes the weights
  directory it was serving if the client that wrote it has exited
  (:func:`~ar_torchrl.backends.sglang.senders.disk.remove_if_orphaned`);
- a watchdog (:mod:`ar_torchrl.backends.sglang.reaper`) stops its process group when this process dies otherwise
  (SIGTERM, SIGHUP, SIGKILL);
- on Linux, launched from the main thread, the server also gets a parent-death signal (SIGTERM).
  ``PR_SET_PDEATHSIG`` fires when the *thread* that forked exits, so it is not set from other
  threads (the watchdog still covers them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from ar_torchrl.backends.sglang import reaper
from ar_torchrl.backends.sglang.errors import SGLangLaunchError
from ar_torchrl.backends.sglang.schema import default_sglang_venv
from ar_torchrl.backends.sglang.senders.disk import remove_if_orphaned

__all__ = [
    "API_KEY_ENV",
    "CPU_SERVER_ARGS",
    "SGLangServer",
    "free_port",
    "launch_sglang_server",
    "log_tail",
    "stop_server",
]

logger = logging.getLogger(__name__)

#: Environment variable holding the SGLang API key (read by the launcher and the client by default).
API_KEY_ENV = "AR_TORCHRL_SGLANG_API_KEY"

#: Flags that run SGLang 0.5.23 on a CPU (tiny models): torch-native attention, fp32, no CUDA graphs.
CPU_SERVER_ARGS = (
    "--attention-backend",
    "torch_native",
    "--dtype",
    "float32",
    "--max-total-tokens",
    "4096",
    "--context-length",
    "512",
    "--cuda-graph-backend-decode",
    "disabled",
    "--cuda-graph-backend-prefill",
    "disabled",
    "--skip-server-warmup",
    "--mem-fraction-static",
    "0.1",
)

# Runs in the server's process before it becomes SGLang: ask for SIGTERM when the parent dies, and
# exit at once if the parent is already gone (the race between fork and prctl).
_PDEATHSIG_SHIM = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or sys.exit('launcher gone'); "
    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])"
)


@dataclass
class SGLangServer:
    """A server started by :func:`launch_sglang_server`."""

    url: str
    process: subprocess.Popen
    log_path: Path
    port: int
    api_key: str | None = None


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
        Path(__file__).resolve().parents[3] / "tools" / "sgl_kernel_shim",
    ):
        if (candidate / "sgl_kernel" / "__init__.py").is_file():
            return candidate
    raise FileNotFoundError(
        f"sgl_kernel import shim not found next to {python} or in tools/; run `bash scripts/setup_sglang_env.sh`"
    )


def _server_env(
    device: str, python: Path, shim_dir, env: Mapping[str, str] | None
) -> dict[str, str]:
    out = dict(os.environ)
    out.update(env or {})
    if device == "cpu":
        shim = _shim_dir(python, shim_dir)
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
        with contextlib.suppress(requests.exceptions.RequestException):  # /health needs no key
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
    reaper.release_process_group(process.pid)


@contextlib.contextmanager
def launch_sglang_server(
    model_path: str | Path,
    *,
    python: str | Path | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
    device: str = "cpu",
    api_key: str | None = None,
    extra_args: Sequence[str] = (),
    log_file: str | Path | None = None,
    timeout_s: float = 300.0,
    shim_dir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[SGLangServer]:
    """Start ``python -m sglang.launch_server`` and stop it on exit (see the module docstring).

    On ``device="cpu"`` the env gets ``SGLANG_USE_CPU_ENGINE=1`` and the ``sgl_kernel`` shim on
    ``PYTHONPATH``, and :data:`CPU_SERVER_ARGS` are passed before ``extra_args`` (later flags win).

    Args:
        model_path: HF model directory.
        python: the server venv's interpreter (default ``.venv-sglang/bin/python``).
        port: HTTP port (default: a free one; retried up to 3 times if SGLang's children take it).
        api_key: the server's ``--api-key`` (default ``$AR_TORCHRL_SGLANG_API_KEY``, if set).
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
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    log_path = Path(log_file) if log_file else Path(_tempfile("sglang-server-", ".log"))
    args = ["--model-path", str(model_path), "--host", host, "--device", device]
    args += list(CPU_SERVER_ARGS if device == "cpu" else ()) + list(extra_args)
    args += ["--api-key", api_key] if api_key else []
    env = _server_env(device, python, shim_dir, env)
    attempts = 1 if port else 3  # an auto-picked port can be taken by SGLang's own children
    for attempt in range(1, attempts + 1):
        try:
            server = _start_server(
                python, args, host, port or free_port(host), log_path, timeout_s, env
            )
            break
        except _PortTaken as err:
            if attempt == attempts:
                raise SGLangLaunchError(str(err)) from err
            logger.warning("SGLang: %s; retrying on another port (%d/%d)", err, attempt, attempts)
    server.api_key = api_key
    try:
        yield server
    finally:
        served = _served_path(server)
        stop_server(server.process)
        if served is not None:  # a dir a client left to it when that client exited
            remove_if_orphaned(served)


def _served_path(server: SGLangServer) -> Path | None:
    """The directory the server loads its weights from now (``None`` when it does not answer)."""
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    try:
        return Path(
            requests.get(server.url + "/model_info", headers=headers, timeout=5).json()[
                "model_path"
            ]
        )
    except Exception:  # noqa: BLE001 - a dead or odd server serves nothing we must clean
        return None


class _PortTaken(SGLangLaunchError):
    """The server could not bind its HTTP port (taken between our pick and its bind)."""


def _command(python: Path, args: list[str]) -> list[str]:
    cmd = ["-m", "sglang.launch_server", *args]
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        return [str(python), "-c", _PDEATHSIG_SHIM, str(os.getpid()), *cmd]
    return [str(python), *cmd]


def _start_server(python, args, host, port, log_path, timeout_s, env) -> SGLangServer:
    """Start one server process and wait until it is healthy (stopping it on failure)."""
    cmd = _command(python, [*args, "--port", str(port)])
    logger.info(
        "launching SGLang: %s (log %s)", " ".join(c for c in cmd if c != _PDEATHSIG_SHIM), log_path
    )
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    reaper.guard_process_group(process.pid)
    server = SGLangServer(
        url=f"http://{host}:{port}", process=process, log_path=log_path, port=port
    )
    try:
        _wait_healthy(server, timeout_s)
    except BaseException as err:
        stop_server(process)
        with open(log_path, "rb") as f:
            f.seek(offset)
            taken = b"address already in use" in f.read().lower()
        if taken and isinstance(err, SGLangLaunchError):
            raise _PortTaken(f"port {port} was taken before the server bound it") from err
        raise
    logger.info("SGLang server healthy at %s (pid %d)", server.url, process.pid)
    return server


def _tempfile(prefix: str, suffix: str) -> str:
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return path
