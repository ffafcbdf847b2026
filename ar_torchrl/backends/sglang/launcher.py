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

What a launched server leaves behind: nothing, whatever stops it. Its ``owned_dirs`` (e.g. the
copy of the starting policy it loads), its run directory (SGLang's temp files: ``TMPDIR`` points
there, so its ZMQ sockets and temp files of ``/tmp`` go with it; torch's rendezvous file) and the
16 KiB ``/dev/shm/sglang_loads_*.shm`` file its scheduler maps (SGLang names it after a random
instance id and never removes it; it is found in the server's ``/proc/<pid>/maps``) are removed
after it stopped, by the context manager or by the watchdog.

Secrets (``api_key``; ``--api-key``, ``--admin-api-key``, ``--ssl-keyfile-password`` in
``extra_args``) never appear in a command line (``ps``, ``/proc/<pid>/cmdline``) nor in this
module's log lines: they travel through a pipe to a small Python prelude that runs in the server's
interpreter, appends them to SGLang's in-memory ``sys.argv`` and installs a log-record factory that
writes ``<redacted>`` for them in every log line of SGLang's main process (SGLang 0.5.23 logs its
whole ``server_args``, key included, at start). The key is not passed through the server's
environment either (``$AR_TORCHRL_SGLANG_API_KEY`` is removed from it). What SGLang itself still
exposes, measured with 0.5.23:

- ``GET /server_info`` answers with every server argument, ``api_key`` included in clear, to any
  client that holds the key (the endpoint needs it);
- the in-memory ``sys.argv`` of its processes holds the flags (SGLang's crash and request dumps
  record that command line when ``--crash-dump-folder`` or request dumping is enabled);
- its child processes (scheduler, detokenizer) do not get the log filter; in 0.5.23 they log no
  server argument.

Network: the HTTP port is bound on ``host``. SGLang's scheduler would also open torch's
``TCPStore`` (the rendezvous of its internal process group) on *all* interfaces (``*:<port>``,
whatever ``--host``): the ``tcp://`` rendezvous binds its store that way (only a pre-bound socket,
``master_listen_fd``, narrows it, and SGLang does not pass one). The launcher avoids it with
a file rendezvous (``SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE=file://<run dir>/...``, which SGLang
0.5.23 reads), unless the server is multi-node (``--nnodes``/``--dist-init-addr`` in
``extra_args``) or the variable is already set. For a loopback ``host``, ``GLOO_SOCKET_IFNAME=lo``
(unless set) keeps gloo's sockets (one per process group) on loopback too; by default gloo binds
the address the machine's hostname resolves to.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
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
from dataclasses import dataclass, field
from pathlib import Path

import requests

from ar_torchrl.backends.sglang import reaper
from ar_torchrl.backends.sglang.errors import SGLangLaunchError
from ar_torchrl.backends.sglang.schema import default_sglang_venv
from ar_torchrl.backends.sglang.senders.disk import remove_if_orphaned

__all__ = [
    "API_KEY_ENV",
    "CPU_SERVER_ARGS",
    "SECRET_FLAGS",
    "SHM_PREFIXES",
    "SGLangServer",
    "free_port",
    "launch_sglang_server",
    "log_tail",
    "split_secret_args",
    "stop_server",
]

logger = logging.getLogger(__name__)

#: Environment variable holding the SGLang API key (read by the launcher and the client by default).
API_KEY_ENV = "AR_TORCHRL_SGLANG_API_KEY"

#: ``sglang.launch_server`` flags whose value is a secret: passed through a pipe, never in argv.
SECRET_FLAGS = ("--api-key", "--admin-api-key", "--ssl-keyfile-password")

#: Prefixes of the ``/dev/shm`` files a server maps that are removed once it stopped.
SHM_PREFIXES = ("sglang_loads_",)

_DIST_INIT_ENV = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"

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
    # An idle scheduler otherwise polls its sockets without pause and holds one core at ~100 %
    # (measured: 97 % CPU through a whole test session), half of a 2-core machine's trainer.
    "--sleep-on-idle",
)

# Runs in the server's interpreter before it becomes SGLang (argv: parent pid or 0, the secrets'
# pipe fd or -1, SGLang's flags). With a parent pid: ask for SIGTERM when the parent dies and exit
# at once if it is already gone (the race between fork and prctl). The secret flags are read from
# the pipe and appended to the in-memory sys.argv only; a log-record factory hides their values.
# The last line (``_MAIN_TAIL``) starts the program; ``prelude`` swaps it (the router's launcher).
_MAIN_TAIL = 'runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)'
_SERVER_MAIN = """
import ctypes, json, logging, os, runpy, signal, sys

parent, fd, args = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
if parent:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != parent:
        sys.exit("launcher gone")
if fd >= 0:
    with os.fdopen(fd, "rb") as pipe:
        secret = json.loads(pipe.read())
    args += secret
    values = [v for v in secret[1::2] if v]
    make_record = logging.getLogRecordFactory()

    def hide(text):
        for value in values:
            text = text.replace(value, "<redacted>")
        return text

    def record(*a, **kw):
        rec = make_record(*a, **kw)
        if isinstance(rec.msg, str):
            rec.msg = hide(rec.msg)
        if isinstance(rec.args, tuple) and any(v in str(x) for x in rec.args for v in values):
            rec.args = tuple(hide(str(x)) if hide(str(x)) != str(x) else x for x in rec.args)
        return rec

    logging.setLogRecordFactory(record)
sys.argv = [sys.argv[0], *args]
runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
"""


def prelude(main: str) -> str:
    """The launcher's prelude (parent-death signal, secrets through a pipe, redacted log lines)
    followed by ``main``, Python code run in its place of ``sglang.launch_server`` (``sys.argv``
    holds the flags then).

    Example:
        >>> prelude("print(sys.argv)").splitlines()[-2:]
        ['sys.argv = [sys.argv[0], *args]', 'print(sys.argv)']
    """
    assert _SERVER_MAIN.endswith(_MAIN_TAIL + "\n")
    return _SERVER_MAIN[: -len(_MAIN_TAIL) - 1] + main.strip() + "\n"


@dataclass
class SGLangServer:
    """A server started by :func:`launch_sglang_server` (``api_key`` is left out of its repr)."""

    url: str
    process: subprocess.Popen
    log_path: Path
    port: int
    api_key: str | None = field(default=None, repr=False)
    run_dir: Path | None = None
    shm_files: list[str] = field(default_factory=list)


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
    device: str,
    python: Path,
    shim_dir,
    env: Mapping[str, str] | None,
    *,
    host: str = "127.0.0.1",
    run_dir: Path | None = None,
    args: Sequence[str] = (),
) -> dict[str, str]:
    """The server's environment: ours without the API key, plus ``env``, the CPU shim, the run
    directory as ``TMPDIR``, and loopback-only networking for a loopback ``host``."""
    out = dict(os.environ)
    out.pop(API_KEY_ENV, None)  # the server gets its key through a pipe (see the module docstring)
    out.update(env or {})
    if device == "cpu":
        shim = _shim_dir(python, shim_dir)
        out["SGLANG_USE_CPU_ENGINE"] = "1"
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), out.get("PYTHONPATH", "")) if p)
    if run_dir is not None and len(str(run_dir)) < 60:  # ZMQ ipc paths must stay < 108 bytes
        # torch's default compile cache lives in the temp dir: keep it where it was
        out.setdefault(
            "TORCHINDUCTOR_CACHE_DIR",
            os.path.join(tempfile.gettempdir(), f"torchinductor_{_user()}"),
        )
        out["TMPDIR"] = str(run_dir)
    if _is_loopback(host) and Path("/sys/class/net/lo").exists():
        out.setdefault("GLOO_SOCKET_IFNAME", "lo")
    multi_node = any(
        a.split("=")[0] in ("--nnodes", "--dist-init-addr", "--nccl-init-addr") for a in args
    )
    if run_dir is not None and not multi_node and _DIST_INIT_ENV not in out:
        out[_DIST_INIT_ENV] = f"file://{run_dir}/dist-store"  # the launcher adds the port
    return out


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_secret_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split flags into (public, secret) ones (:data:`SECRET_FLAGS`; ``--flag value`` or
    ``--flag=value``; secret ones come back as ``--flag value`` pairs).

    Example:
        >>> split_secret_args(["--port", "1", "--api-key", "k", "--admin-api-key=a"])
        (['--port', '1'], ['--api-key', 'k', '--admin-api-key', 'a'])
    """
    public, secret, items = [], [], iter(args)
    for arg in items:
        flag, eq, value = str(arg).partition("=")
        if flag in SECRET_FLAGS:
            secret += [flag, value if eq else next(items, "")]
        else:
            public.append(arg)
    return public, secret


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


def stop_server(
    process: subprocess.Popen, grace_s: float = 20.0, shm_prefixes: Sequence[str] = SHM_PREFIXES
) -> None:
    """SIGTERM the server's main pid, SIGKILL it after ``grace_s``, then SIGKILL stray children;
    then unlink the ``/dev/shm/<prefix>*`` files its processes had mapped."""
    shm = reaper.mapped_shm_files(process.pid, shm_prefixes)
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # its own session: only its children are left in it
    for path in shm:
        reaper.remove_path(path)
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
    owned_dirs: Sequence[str | Path] = (),
) -> Iterator[SGLangServer]:
    """Start ``python -m sglang.launch_server`` and stop it on exit (see the module docstring).

    On ``device="cpu"`` the env gets ``SGLANG_USE_CPU_ENGINE=1`` and the ``sgl_kernel`` shim on
    ``PYTHONPATH``, and :data:`CPU_SERVER_ARGS` are passed before ``extra_args`` (later flags win).

    Args:
        model_path: HF model directory.
        python: the server venv's interpreter (default ``.venv-sglang/bin/python``).
        port: HTTP port (default: a free one; retried up to 3 times if SGLang's children take it).
        api_key: the server's ``--api-key`` (default ``$AR_TORCHRL_SGLANG_API_KEY``, if set);
            passed through a pipe, never on the command line.
        log_file: where the server writes (default: a temp file).
        timeout_s: how long to wait for health.
        owned_dirs: directories that belong to this server (e.g. the copy of the weights it
            starts from): removed once it stopped, whatever stops it (also a failed launch, and
            this process's death: see :mod:`~ar_torchrl.backends.sglang.reaper`).

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
    owned = [Path(d) for d in owned_dirs]
    for path in owned:
        reaper.guard_dir(path)
    run_dir: Path | None = None
    try:
        python = _server_python(python)
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        log_path = Path(log_file) if log_file else Path(_tempfile("sglang-server-", ".log"))
        public, secret = split_secret_args(extra_args)
        secret += ["--api-key", api_key] if api_key else []
        api_key = api_key or _last_value(secret, "--api-key")
        args = ["--model-path", str(model_path), "--host", host, "--device", device]
        args += list(CPU_SERVER_ARGS if device == "cpu" else ()) + public
        run_dir = Path(tempfile.mkdtemp(prefix="ar_torchrl-sglang-"))
        owned.append(run_dir)
        reaper.guard_dir(run_dir)
        env = _server_env(device, python, shim_dir, env, host=host, run_dir=run_dir, args=args)
        attempts = 1 if port else 3  # an auto-picked port can be taken by SGLang's own children
        for attempt in range(1, attempts + 1):
            try:
                server = _start_server(
                    python, args, secret, host, port or free_port(host), log_path, timeout_s, env
                )
                break
            except _PortTaken as err:
                if attempt == attempts:
                    raise SGLangLaunchError(str(err)) from err
                logger.warning(
                    "SGLang: %s; retrying on another port (%d/%d)", err, attempt, attempts
                )
        server.api_key, server.run_dir = api_key, run_dir
        try:
            yield server
        finally:
            served = _served_path(server)
            stop_server(server.process)
            for path in server.shm_files:
                reaper.remove_path(path)
                reaper.release_dir(path)
            if served is not None:  # a dir a client left to it when that client exited
                remove_if_orphaned(served)
    finally:
        for path in owned:
            reaper.remove_path(path)
            reaper.release_dir(path)


def _last_value(pairs: Sequence[str], flag: str) -> str | None:
    values = [v for f, v in zip(pairs[::2], pairs[1::2]) if f == flag]
    return values[-1] if values else None


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


def _command(
    python: Path, args: list[str], secret_fd: int = -1, main: str = _SERVER_MAIN
) -> list[str]:
    """``python -c <prelude> <parent pid or 0> <secrets fd or -1> <flags>`` (see ``_SERVER_MAIN``;
    ``main``: another program behind the same prelude, see :func:`prelude`)."""
    main_thread = threading.current_thread() is threading.main_thread()
    parent = os.getpid() if sys.platform.startswith("linux") and main_thread else 0
    return [str(python), "-c", main, str(parent), str(secret_fd), *args]


def spawn_guarded(
    python: Path,
    args: list[str],
    secret: list[str],
    log_path: Path,
    env: Mapping[str, str],
    *,
    main: str = _SERVER_MAIN,
    shm_prefixes: tuple[str, ...] = (),
) -> subprocess.Popen:
    """Start ``main`` (see :func:`_command`) in a new session, ``secret`` flags through a pipe
    (never on a command line), output appended to ``log_path`` (mode 0600: private to this user,
    SGLang logs its server arguments), and the process group in the reaper's care
    (:func:`reaper.guard_process_group`, with ``shm_prefixes``)."""
    read_fd = -1
    if secret:  # a few bytes: the pipe holds them until the child reads them
        read_fd, write_fd = os.pipe()
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(json.dumps(secret).encode())
    try:
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            process = subprocess.Popen(
                _command(python, args, read_fd, main=main),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env),
                start_new_session=True,
                pass_fds=(read_fd,) if read_fd >= 0 else (),
            )
    finally:
        if read_fd >= 0:
            os.close(read_fd)
    reaper.guard_process_group(process.pid, shm_prefixes)
    return process


def _start_server(python, args, secret, host, port, log_path, timeout_s, env) -> SGLangServer:
    """Start one server process and wait until it is healthy (stopping it on failure)."""
    args = [*args, "--port", str(port)]
    if _DIST_INIT_ENV in env and env[_DIST_INIT_ENV].endswith("/dist-store"):
        env = {**env, _DIST_INIT_ENV: f"{env[_DIST_INIT_ENV]}-{port}"}  # a fresh one per attempt
    logger.info(
        "launching SGLang: %s -m sglang.launch_server %s%s (log %s)",
        python,
        " ".join(args),
        f" + {' '.join(secret[::2])} through a pipe" if secret else "",
        log_path,
    )
    offset = log_path.stat().st_size if log_path.exists() else 0
    process = spawn_guarded(python, args, secret, log_path, env, shm_prefixes=SHM_PREFIXES)
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
    server.shm_files = reaper.mapped_shm_files(process.pid, SHM_PREFIXES)
    for path in server.shm_files:  # also removed if the server dies first and then this process
        reaper.guard_dir(path)
    logger.info("SGLang server healthy at %s (pid %d)", server.url, process.pid)
    return server


def _tempfile(prefix: str, suffix: str) -> str:
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return path
