"""launch_sglang_server: failures carry the log, a taken port is retried, and the server never
outlives the process that launched it (real servers killed with their parent: SIGKILL, SIGTERM)."""

from __future__ import annotations

import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from sglang_helpers import ParentServer, alive, group_pids, wait_until

import ar_torchrl.backends.sglang.launcher as launcher
from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.sglang import (
    SGLangBackend,
    SGLangLaunchError,
    SGLangUnavailableError,
    launch_sglang_server,
)

ROOT = Path(__file__).resolve().parents[1]


def _fake_sglang(root: Path) -> Path:
    pkg = root / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        textwrap.dedent('''
        """A stand-in for sglang.launch_server: binds --host/--port for real, answers /health."""
        import http.server, sys

        argv = sys.argv[1:]
        host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])

        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

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
    cmd = launcher._command(Path("/venv/bin/python"), ["--port", "1"])
    assert (
        cmd[1] == "-c"
        and "prctl" in cmd[2]
        and cmd[4:] == ["-m", "sglang.launch_server", "--port", "1"]
    )
    box = {}
    worker = threading.Thread(target=lambda: box.update(cmd=launcher._command(Path("/p"), [])))
    worker.start(), worker.join()
    assert box["cmd"] == ["/p", "-m", "sglang.launch_server"]  # PDEATHSIG would fire when it exits


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
    assert wait_until(lambda: not any(d.exists() for d in server.dirs), 10) < 10, server.dirs


@pytest.mark.sglang
@pytest.mark.slow
def test_a_real_server_dies_when_its_trainer_is_sigkilled(second_server):
    """(Runs after the two-server tests, reusing that server.) SIGKILL: no finally, no atexit."""
    server = second_server.get()
    children = group_pids(server.pid)
    assert len(children) >= 3 and all(
        d.is_dir() for d in server.dirs
    )  # main + scheduler + detokenizer
    server.kill_parent(signal.SIGKILL)
    _assert_gone(server)


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
