"""math-verify equivalence, and a worker process that runs it for threads other than the main one.

math-verify bounds its sympy work with ``signal.alarm``, which only works in the main thread of the
main interpreter; called from another thread (the async collector scores rollouts in a background
thread) it raises, which used to be swallowed as "not equivalent" (``0.5`` vs ``\\frac{1}{2}``: +1 on
the main thread, -1 in a thread). Here every call runs math-verify *in a main thread*, with its own
timeouts: directly on the main thread, else in this small worker process (started once, one JSON
line per request), so the answer is the same in any thread and the work stays bounded.

The worker runs :func:`main` (stdin: ``[pred, truth]`` JSON lines; stdout: ``true``/``false`` lines);
the parent side is :class:`MathVerifyWorker`.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import logging
import os
import select
import subprocess
import sys
import threading

__all__ = ["MathVerifyWorker", "math_verify_equal", "require_math_verify"]

logger = logging.getLogger(__name__)


def require_math_verify() -> None:
    """Raise an ``ImportError`` naming the extra to install when ``math-verify`` is missing."""
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(
            "dapo_math_reward(use_math_verify=True) needs the `math-verify` package: "
            "pip install 'ar_torchrl[math]'"
        )


def math_verify_equal(pred: str, truth: str) -> bool:
    """``math_verify.verify(parse($truth$), parse($pred$))`` with its own (signal) timeouts.

    Must run in a main thread. A parse error (malformed TeX) or a timeout means "not equivalent".
    """
    require_math_verify()
    math_verify = importlib.import_module("math_verify")
    try:
        gold, answer = math_verify.parse(f"${truth}$"), math_verify.parse(f"${pred}$")
        return bool(math_verify.verify(gold, answer))
    except Exception:  # math-verify's parser raises on malformed TeX: not equivalent
        return False


class MathVerifyWorker:
    """A lazily started worker process answering :func:`math_verify_equal` (thread-safe).

    Args:
        timeout: seconds to wait for one answer before the worker is killed (and restarted on the
            next call); math-verify's own timeouts (5 s per parse / comparison) normally fire first.
    """

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        atexit.register(self.close)

    def equal(self, pred: str, truth: str) -> bool | None:
        """The worker's answer, or ``None`` if it died or timed out (the caller counts it)."""
        with self._lock:
            proc = self._start()
            try:
                proc.stdin.write(json.dumps([pred, truth]) + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], self.timeout)
                line = proc.stdout.readline() if ready else ""
            except (BrokenPipeError, OSError):
                line = ""
            if line.strip() in ("true", "false"):
                return line.strip() == "true"
            logger.warning(
                "math-verify worker gave no answer in %.0f s: restarting it", self.timeout
            )
            self._kill()
            return None

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            code = "from ar_torchrl.rewards._math_verify_worker import main; main()"
            cmd = [sys.executable, "-c", code]
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
                env=dict(os.environ),
            )
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the worker (closing its stdin ends its loop; killed if it does not exit)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def main() -> None:
    for line in sys.stdin:
        pred, truth = json.loads(line)
        print("true" if math_verify_equal(pred, truth) else "false", flush=True)
