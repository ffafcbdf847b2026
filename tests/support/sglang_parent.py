"""A stand-in trainer for the tests: launch an SGLang server from this process, report, and wait.

Usage: ``python tests/support/sglang_parent.py MODEL_DIR LOG SERVER_PYTHON [--sync]``. The server starts
from a private copy of ``MODEL_DIR`` that it owns (``owned_dirs``, as the recipe's
``run_dir/sglang_model``); this process logs (INFO) to ``LOG.trainer``. When the server is healthy
it prints one JSON line ``{"url", "pid", "dirs", "owned", "trainer_log"}`` (with ``--sync``, after
one disk weight sync, whose temp dirs are listed, and one tensor sync, which makes torch start a
``torch_shm_manager``), then waits for the end of its stdin and stops the server. The tests kill
this process with signals instead, to check that nothing it started survives it.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

from ar_torchrl.backends.sglang import SGLangBackend, launch_sglang_server


def main() -> None:
    model_dir, log, python = sys.argv[1:4]
    logging.basicConfig(level=logging.INFO, filename=f"{log}.trainer")
    owned = Path(tempfile.mkdtemp(prefix="ar_torchrl-test-model-"))
    shutil.copytree(model_dir, owned, dirs_exist_ok=True)
    with launch_sglang_server(
        owned, python=python, log_file=log, timeout_s=600, owned_dirs=[owned]
    ) as server:
        dirs = []
        if "--sync" in sys.argv:
            from ar_torchrl.models.tiny import build_tiny_qwen3
            from ar_torchrl.weight_sync import named_policy_tensors

            model = build_tiny_qwen3(99, seed=0)
            backend = SGLangBackend(server.url, show_progress=False)
            backend.sync_weights(named_policy_tensors(model), version=1)
            sender = backend.sender
            dirs = [str(sender._last_dir), str(sender._snapshot)]
            assert all(Path(d).is_dir() for d in dirs)
            SGLangBackend(server.url, weight_sync="tensor", show_progress=False).sync_weights(
                named_policy_tensors(model), version=2
            )
        info = {"url": server.url, "pid": server.process.pid, "dirs": dirs, "owned": str(owned)}
        print(json.dumps({**info, "trainer_log": f"{log}.trainer"}), flush=True)
        sys.stdin.read()  # until the test closes our stdin (or kills us)


if __name__ == "__main__":
    main()
