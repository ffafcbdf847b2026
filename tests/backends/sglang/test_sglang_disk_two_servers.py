"""DiskWeightSender over two real servers: a sync that fails on one of them keeps the directory
the other one loaded, so that the next run starts against both.

(A file of its own so that it runs before ``test_sglang_launcher.py``, whose SIGKILL test ends the
session's second server.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.sglang_helpers import ROOT, assert_server_matches, trainer_with_value_head

from ar_torchrl.backends.sglang import SGLangBackend
from ar_torchrl.weight_sync import named_policy_tensors

# A run that syncs both servers, then syncs again while server B fails to load (it is sent an
# empty directory: SGLang answers 400 "Cannot find any model weights" and keeps its weights),
# reports the error, and dies without cleaning up (SIGKILL: the reaper alone decides).
FAILING_RUN = """
import json, os, signal, sys, tempfile
from ar_torchrl.backends.sglang import SGLangBackend
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors

a, b = sys.argv[1:3]
backend = SGLangBackend([a, b], weight_sync="disk", show_progress=False)
backend.sync_weights(named_policy_tensors(build_tiny_qwen3(99, seed=3)), version=51)
empty, inner = tempfile.mkdtemp(prefix="ar_torchrl-test-empty-"), backend.session.request

def request(method, url, json=None, **kw):
    if url == b + "/update_weights_from_disk":
        json = {**json, "model_path": empty}
    return inner(method, url, json=json, **kw)

backend.session.request = request
try:
    backend.sync_weights(named_policy_tensors(build_tiny_qwen3(99, seed=4)), version=52)
except WeightSyncError as err:
    print(json.dumps({"error": str(err), "partial": err.partial}), flush=True)
os.rmdir(empty)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.sglang
@pytest.mark.slow
def test_a_sync_that_failed_on_one_server_keeps_what_the_other_serves(sglang_server, second_server):
    a, b = sglang_server.url, second_server.get().url
    run = subprocess.run(
        [sys.executable, "-c", FAILING_RUN, a, b],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.stdout, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["partial"] and "failed on 1 of 2 server(s)" in report["error"]
    assert "Cannot find any model weights" in report["error"]
    with SGLangBackend([a, b], weight_sync="disk", show_progress=False) as probe:
        info = {url: probe.get(url, "/model_info") for url in (a, b)}
    served = {url: Path(i["model_path"]) for url, i in info.items()}
    assert (info[a]["weight_version"], info[b]["weight_version"]) == ("52", "51")
    # A loaded the failed sync's dir, B still serves the previous one: both outlived the run
    assert served[a] != served[b] and all(p.is_dir() for p in served.values()), served

    # a new run against both servers starts (its config source is A's dir), syncs and generates
    model = trainer_with_value_head(seed=53)
    with SGLangBackend([a, b], weight_sync="disk", show_progress=False) as backend:
        backend.sync_weights(named_policy_tensors(model), version=53)
        assert_server_matches(backend, model, 53)
        now = {url: Path(backend.get(url, "/model_info")["model_path"]) for url in (a, b)}
    assert now[a] == now[b] and now[a].is_dir()
    # the dead run's dirs, no longer served, were removed by that sync
    assert not any(p.exists() for p in served.values()), served
