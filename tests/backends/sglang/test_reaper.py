"""reaper: whatever kills a process (SIGTERM, SIGHUP, SIGKILL), its guarded process groups and temp
dirs go with it; a dir a live server still serves is kept. A real SGLang server is checked the same
way in test_sglang_launcher.py; here the guarded "server" is a cheap process tree."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.sglang_helpers import group_pids, wait_until

ROOT = Path(__file__).resolve().parents[3]

# A stand-in owner: starts a process group (a shell with a child), guards it and two dirs, then waits.
OWNER = """
import json, signal, subprocess, sys, tempfile
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a suite started under nohup: SIGHUP is ignored
from ar_torchrl.backends.sglang import reaper
tree = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300; wait"], start_new_session=True)
dirs = [tempfile.mkdtemp(prefix="ar_torchrl-test-"), tempfile.mkdtemp(prefix="ar_torchrl-test-")]
reaper.guard_process_group(tree.pid)
reaper.guard_dir(dirs[0])
reaper.guard_dir(dirs[1], urls=[sys.argv[1]] if len(sys.argv) > 1 else [], api_key="k")
print(json.dumps({"pgid": tree.pid, "dirs": dirs}), flush=True)
sys.stdin.read()
"""


def start_owner(*args: str) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    info = json.loads(owner.stdout.readline())
    assert wait_until(lambda: len(group_pids(info["pgid"])) >= 2, 10) < 10
    return owner, info


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_guarded_group_and_dirs_die_with_their_owner(sig):
    owner, info = start_owner()
    os.kill(owner.pid, sig)
    owner.wait(10)
    assert wait_until(lambda: not group_pids(info["pgid"]), 10) < 10, (
        "the process group outlived its owner"
    )
    assert wait_until(lambda: not any(Path(d).exists() for d in info["dirs"]), 10) < 10


def test_a_clean_exit_cleans_up_too_and_released_things_stay():
    owner, info = start_owner()
    owner.stdin.close()  # the owner exits normally without releasing anything
    owner.wait(10)
    assert wait_until(lambda: not group_pids(info["pgid"]), 10) < 10
    assert wait_until(lambda: not any(Path(d).exists() for d in info["dirs"]), 10) < 10
    from ar_torchrl.backends.sglang import reaper

    kept = tempfile.mkdtemp(prefix="ar_torchrl-test-")
    reaper.guard_dir(kept)
    reaper.release_dir(kept)
    assert Path(kept).is_dir()
    os.rmdir(kept)


def test_a_dir_a_live_server_serves_is_kept():
    served: dict = {}

    class ModelInfo(BaseHTTPRequestHandler):
        def do_GET(self):
            served["auth"] = self.headers.get("Authorization")
            data = json.dumps({"model_path": served["path"]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), ModelInfo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        owner, info = start_owner(f"http://127.0.0.1:{server.server_address[1]}")
        served["path"] = info["dirs"][1]
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        # the reaper asked the server (with the API key) before deciding
        assert wait_until(lambda: "auth" in served and not Path(info["dirs"][0]).exists(), 10) < 10
        time.sleep(0.5)
        assert Path(info["dirs"][1]).is_dir() and served["auth"] == "Bearer k"
    finally:
        server.shutdown()
        for d in info["dirs"]:
            if Path(d).exists():
                os.rmdir(d)


# A stand-in "server" group whose process maps a /dev/shm file (as SGLang's scheduler maps its
# sglang_loads_*.shm), next to a file of the same prefix that nobody maps.
MAPPER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
view = mmap.mmap(fd, 4096)
print("mapped", flush=True)
time.sleep(300)
"""
SHM_OWNER = """
import json, signal, subprocess, sys, tempfile
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a suite started under nohup: SIGHUP is ignored
from ar_torchrl.backends.sglang import reaper
name = "/dev/shm/ar_torchrl-test-" + tempfile.mktemp(dir="")
tree = subprocess.Popen([sys.executable, "-c", sys.argv[1], name + ".shm"],
                        start_new_session=True, stdout=subprocess.PIPE, text=True)
tree.stdout.readline()
open(name + "-unmapped.shm", "w").close()
reaper.guard_process_group(tree.pid, ["ar_torchrl-test-"])
print(json.dumps({"pgid": tree.pid, "mapped": name + ".shm", "unmapped": name + "-unmapped.shm",
                  "found": reaper.mapped_shm_files(tree.pid, ["ar_torchrl-test-"])}), flush=True)
sys.stdin.read()
"""


def test_the_shm_files_a_guarded_group_maps_are_removed_after_it():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    owner = subprocess.Popen(
        [sys.executable, "-c", SHM_OWNER, MAPPER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    info = json.loads(owner.stdout.readline())
    try:
        assert info["found"] == [info["mapped"]]  # found by mapping, not by name
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        assert wait_until(lambda: not group_pids(info["pgid"]), 10) < 10
        assert wait_until(lambda: not Path(info["mapped"]).exists(), 10) < 10
        assert Path(info["unmapped"]).exists()
    finally:
        for path in (info["mapped"], info["unmapped"]):
            Path(path).unlink(missing_ok=True)
