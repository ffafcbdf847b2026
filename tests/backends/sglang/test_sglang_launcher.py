"""launch_sglang_server: failures carry the log, a taken port is retried, and the server never
outlives the process that launched it (real servers killed with their parent: SIGKILL, SIGTERM)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import requests
from support.sglang_helpers import (
    ParentServer,
    alive,
    children_named,
    group_pids,
    listening_sockets,
    mapped_files,
    wait_until,
)

import ar_torchrl.backends.sglang.launcher as launcher
from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.sglang import (
    SGLangBackend,
    SGLangLaunchError,
    SGLangUnavailableError,
    launch_sglang_server,
)

ROOT = Path(__file__).resolve().parents[3]


def _fake_sglang(root: Path) -> Path:
    pkg = root / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        textwrap.dedent('''
        """A stand-in for sglang.launch_server: binds --host/--port for real, answers /health and
        /argv (its in-memory sys.argv), and logs its flags the way SGLang logs its server_args."""
        import http.server, json, logging, sys

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        logging.info(f"server_args={sys.argv[1:]}")  # formatted before logging sees it
        logging.info("flags %s, first %s", sys.argv[1:], sys.argv[1])  # formatted by logging
        argv = sys.argv[1:]
        host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])

        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps(sys.argv).encode() if self.path == "/argv" else b""
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        try:
            server = http.server.HTTPServer((host, port), Health)
        except OSError as err:  # uvicorn logs the same errno text, lower-cased
            print(f"ERROR: error while attempting to bind on address ({host!r}, {port}): {err}", flush=True)
            sys.exit(1)
        server.serve_forever()
    ''')
    )
    return root


def test_launcher_failure_reports_log_tail(tmp_path):
    # The library venv has no sglang: the server process dies at import, and the error says why.
    with pytest.raises(
        SGLangLaunchError, match=r"(?s)exited with code 1 .*No module named 'sglang'"
    ):
        with launch_sglang_server(
            tmp_path, python=sys.executable, log_file=tmp_path / "log", timeout_s=60
        ):
            pass


def test_a_taken_port_is_retried_on_another(tmp_path, monkeypatch):
    """SGLang's own children bind random ports; when one takes ours first, the launcher retries.
    The bind failure is real (a squatted port); the server is a light stand-in that binds for real."""
    import socket

    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    ports = iter([taken, launcher.free_port()])
    monkeypatch.setattr(launcher, "free_port", lambda host="127.0.0.1": next(ports))
    env = {"PYTHONPATH": str(_fake_sglang(tmp_path / "fake"))}
    try:
        log = tmp_path / "retry.log"
        with launch_sglang_server(
            "model", python=sys.executable, log_file=log, env=env, timeout_s=60
        ) as server:
            assert server.port != taken and SGLangBackend(server.url).health()
            pid = server.process.pid
        assert "Address already in use" in log.read_text() and not alive(pid)
    finally:
        squatter.close()


def test_parent_death_signal_only_from_the_main_thread():
    cmd = launcher._command(Path("/venv/bin/python"), ["--port", "1"], 7)
    assert cmd[1] == "-c" and "prctl" in cmd[2] and "sglang.launch_server" in cmd[2]
    assert cmd[3:] == [str(os.getpid()), "7", "--port", "1"]
    box = {}
    worker = threading.Thread(target=lambda: box.update(cmd=launcher._command(Path("/p"), [])))
    worker.start(), worker.join()
    assert box["cmd"][3:] == ["0", "-1"]  # no PDEATHSIG: it would fire when that thread exits


def test_secrets_reach_the_server_through_a_pipe_and_are_redacted(tmp_path, caplog):
    """--api-key (and secret extra flags) reach the server's in-memory argv, but neither its
    command line, nor our log lines, nor the log lines the server's main process writes."""
    env = {"PYTHONPATH": str(_fake_sglang(tmp_path / "fake"))}
    log = tmp_path / "server.log"
    extra = ["--admin-api-key=admin-s3cret", "--log-level", "info"]
    with caplog.at_level(logging.INFO, logger="ar_torchrl.backends.sglang.launcher"):
        with launch_sglang_server(
            "model",
            python=sys.executable,
            api_key="k3y-s3cret",
            extra_args=extra,
            log_file=log,
            env=env,
            timeout_s=60,
        ) as server:
            argv = requests.get(server.url + "/argv", timeout=10).json()
            cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode()
            environ = Path(f"/proc/{server.process.pid}/environ").read_bytes().decode()
    assert argv[-4:] == ["--admin-api-key", "admin-s3cret", "--api-key", "k3y-s3cret"]
    assert "--log-level" in argv and server.api_key == "k3y-s3cret"
    assert "k3y-s3cret" not in repr(server)
    for secret in ("k3y-s3cret", "admin-s3cret"):
        assert secret not in cmdline and secret not in environ and secret not in caplog.text
        assert secret not in log.read_text()
    assert "+ --admin-api-key --api-key through a pipe" in caplog.text  # the names only
    assert log.read_text().count("<redacted>") == 4, log.read_text()  # 2 in each log line


def test_sgl_kernel_shim_raises_naming_the_op(monkeypatch):
    shim = ROOT / "tools" / "sgl_kernel_shim"
    monkeypatch.syspath_prepend(str(shim))
    for name in ("sgl_kernel", "sgl_kernel._shim", "sgl_kernel.mamba"):  # import fresh, drop after
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    import sgl_kernel
    from sgl_kernel.mamba import causal_conv1d_fwd

    with pytest.raises(
        NotImplementedError, match=r"sgl_kernel.fused_add_rmsnorm was called.*CPU import shim"
    ):
        sgl_kernel.fused_add_rmsnorm(1, 2)
    with pytest.raises(NotImplementedError, match=r"sgl_kernel.mamba.causal_conv1d_fwd was called"):
        causal_conv1d_fwd()
    assert not hasattr(sgl_kernel, "__wrapped__")  # dunders are real AttributeErrors
    assert Path(sgl_kernel.__file__).is_relative_to(shim)


def _assert_gone(server: ParentServer) -> None:
    took = wait_until(lambda: not group_pids(server.pid), 10)
    assert took < 10, (
        f"server (pid {server.pid}) and children {group_pids(server.pid)} outlived the trainer"
    )
    dirs = [*server.dirs, server.owned]  # weight syncs' dirs, the server's own start weights
    assert wait_until(lambda: not any(d.exists() for d in dirs), 10) < 10, dirs


@pytest.mark.sglang
@pytest.mark.slow
def test_launched_servers_keep_the_key_private_and_listen_on_loopback_only(
    sglang_server, second_server, sglang_api_key
):
    """(Before the SIGKILL test below, which ends the second server.) The API key is in no command
    line or environment of the servers' processes, in no log line of the trainer, and SGLang's own
    ``server_args`` dump shows it redacted; no server process listens on a wildcard address
    (SGLang's scheduler opened torch's TCPStore on ``::`` whatever ``--host``)."""
    second = second_server.get()
    for pgid, log, url in (
        (sglang_server.process.pid, sglang_server.log_path, sglang_server.url),
        (second.pid, second.log, second.url),
    ):
        pids = group_pids(pgid)
        assert len(pids) >= 3  # main + scheduler + detokenizer (+ resource tracker)
        for pid in pids:
            for part in ("cmdline", "environ"):
                assert sglang_api_key.encode() not in Path(f"/proc/{pid}/{part}").read_bytes()
        text = log.read_text()
        assert sglang_api_key not in text
        assert text.count("'api_key': '<redacted>'") == 1, "SGLang's server_args dump changed"
        sockets = listening_sockets(pids)
        assert ("127.0.0.1", int(url.rsplit(":", 1)[1])) in sockets
        assert not [s for s in sockets if s[0] in ("0.0.0.0", "::")], sockets
        assert {address for address, _ in sockets} == {"127.0.0.1"}  # gloo's too (lo)
        # SGLang itself answers GET /server_info with every argument, the key in clear, to any
        # client that holds the key (documented in the launcher's docstring)
        with SGLangBackend(url, show_progress=False) as backend:
            assert backend.get(url, "/server_info")["api_key"] == sglang_api_key
    trainer = second.trainer_log.read_text()  # the stand-in trainer's own log (INFO)
    assert "launching SGLang" in trainer and "+ --api-key through a pipe" in trainer
    assert "SGLang disk weight sync" in trainer and "SGLang tensor weight sync" in trainer
    assert sglang_api_key not in trainer


@pytest.mark.sglang
@pytest.mark.slow
def test_a_real_server_dies_when_its_trainer_is_sigkilled(second_server):
    """(Runs after the two-server tests, reusing that server.) SIGKILL: no finally, no atexit.
    Nothing of the trainer's is left: the server's processes, its copy of the start weights
    (``owned_dirs``), the disk syncs' dirs, its ``/dev/shm/sglang_loads_*`` file, and the
    ``torch_shm_manager`` torch started for the tensor sync (the server kept it alive)."""
    server = second_server.get()
    children = group_pids(server.pid)
    shm = mapped_files(children, "/dev/shm/sglang_loads_")
    managers = children_named(server.parent.pid, "torch_shm_manag")
    assert len(children) >= 3 and all(d.is_dir() for d in server.dirs) and server.owned.is_dir()
    assert len(shm) == 1 and all(Path(f).is_file() for f in shm) and len(managers) == 1
    server.kill_parent(signal.SIGKILL)
    _assert_gone(server)
    assert wait_until(lambda: not any(alive(pid) for pid in managers), 10) < 10, managers
    assert not [f for f in shm if Path(f).exists()]


@pytest.mark.sglang
@pytest.mark.slow
def test_a_real_server_dies_mid_rollout_when_its_trainer_gets_sigterm(
    sglang_model_dir, sglang_api_key, tmp_path
):
    server = ParentServer(sglang_model_dir, tmp_path / "victim.log", sync=True)
    backend = SGLangBackend(
        server.url,
        max_retries=2,
        backoff_s=0.2,
        connect_timeout_s=1,
        show_progress=False,
        extra_sampling_params={"ignore_eos": True},
    )
    result: dict = {}

    def rollout():  # ~250k tokens: far longer than the few seconds until the kill
        try:
            result["out"] = backend.generate(
                [[1, 2, 3]] * 64, n=8, sampling=SamplingParams(max_new_tokens=500)
            )
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            result["error"] = exc

    thread = threading.Thread(target=rollout)
    thread.start()
    assert wait_until(lambda: backend.stats["requests"] >= 8, 30) < 30  # every slot in flight
    time.sleep(0.5)  # let the requests reach the scheduler
    server.kill_parent(signal.SIGTERM)
    _assert_gone(server)
    thread.join(60)
    backend.close()
    assert not thread.is_alive() and "out" not in result, (
        "a rollout cannot finish on a killed server"
    )
    assert isinstance(result["error"], SGLangUnavailableError) and backend.retries >= 2
