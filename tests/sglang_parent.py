"""A stand-in trainer for the tests: launch an SGLang server from this process, report, and wait.

Usage: ``python tests/sglang_parent.py MODEL_DIR LOG SERVER_PYTHON [--sync]``. When the server is
healthy it prints one JSON line ``{"url", "pid", "dirs"}`` (with ``--sync``, after one disk weight
sync, whose temp dirs are listed), then waits for the end of its stdin and stops the server. The
tests kill this process with signals instead, to check that nothing it started survives it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ar_torchrl.backends.sglang import SGLangBackend, launch_sglang_server


def main() -> None:
    model_dir, log, python = sys.argv[1:4]
    with launch_sglang_server(model_dir, python=python, log_file=log, timeout_s=600) as server:
        dirs = []
        if "--sync" in sys.argv:
            from ar_torchrl.models.tiny import build_tiny_qwen3
            from ar_torchrl.weight_sync import named_policy_tensors

            backend = SGLangBackend(server.url, show_progress=False)
            backend.sync_weights(named_policy_tensors(build_tiny_qwen3(99, seed=0)), version=1)
            sender = backend.sender
            dirs = [str(sender._last_dir), str(sender._snapshot)]
            assert all(Path(d).is_dir() for d in dirs)
        print(json.dumps({"url": server.url, "pid": server.process.pid, "dirs": dirs}), flush=True)
        sys.stdin.read()  # until the test closes our stdin (or kills us)


if __name__ == "__main__":
    main()
