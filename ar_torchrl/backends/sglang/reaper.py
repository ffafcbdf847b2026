"""Nothing this process starts may outlive it: a watchdog that cleans up when this process dies.

A launched SGLang server (~3 GB of RAM here, GPU memory on a GPU node) and the weight directories
of disk syncs must not survive their trainer, whatever ends it: an exception, SIGTERM, SIGHUP, or
SIGKILL (which runs no ``finally`` and no ``atexit``). The first registration starts one small
watchdog process (this file run as a script, standard library only, in its own session so that a
signal to the trainer's process group does not reach it). It reads registrations from a pipe whose
write end only this process holds; when this process dies for any reason the kernel closes the
pipe, the watchdog reads end-of-file and

- stops every registered process group: SIGTERM to its leader, SIGKILL to the whole group after a
  short grace period (a few seconds in all);
- removes every registered directory, except one that a live server still reports as its
  ``model_path`` (a shared server keeps serving it; its next client reads the config from there).

Registrations are released on a clean stop (the launcher stops its server itself). A child made by
``os.fork`` does not keep the pipe open (it is closed in the child).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

__all__ = ["guard_dir", "guard_process_group", "release_dir", "release_process_group"]

GRACE_S = 3.0
_lock = threading.Lock()
_proc: subprocess.Popen | None = None


def _send(message: dict) -> None:
    global _proc
    with _lock:
        if _proc is None or _proc.poll() is not None:
            _proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(Path(__file__).resolve())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        _proc.stdin.write((json.dumps(message) + "\n").encode())
        _proc.stdin.flush()


def _forget_in_child() -> None:
    global _proc
    if _proc is not None and _proc.stdin is not None:
        _proc.stdin.close()  # the child's copy only: the parent still holds the pipe
    _proc = None


os.register_at_fork(after_in_child=_forget_in_child)


def guard_process_group(pgid: int) -> None:
    """Stop process group ``pgid`` (a server started with ``start_new_session``) if this process dies.

    Example:
        >>> proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
        >>> guard_process_group(proc.pid); release_process_group(proc.pid); proc.kill()
    """
    _send({"op": "guard_group", "pgid": int(pgid)})


def release_process_group(pgid: int) -> None:
    """Forget ``pgid`` (it was stopped cleanly)."""
    _send({"op": "release_group", "pgid": int(pgid)})


def guard_dir(path: str | Path, urls: Sequence[str] = (), api_key: str | None = None) -> None:
    """Remove ``path`` when this process dies, unless a server in ``urls`` still serves it.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(prefix="ar_torchrl-doc-")
        >>> guard_dir(d); release_dir(d); os.rmdir(d)
    """
    _send({"op": "guard_dir", "path": str(path), "urls": list(urls), "api_key": api_key})


def release_dir(path: str | Path) -> None:
    """Forget ``path`` (it was removed, or it is no longer this process's to remove)."""
    _send({"op": "release_dir", "path": str(path)})


# ------------------------------------------------------------------------- the watchdog process
def _group_alive(pgid: int) -> bool:
    """Is any non-zombie process left in group ``pgid``?"""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _stop_group(pgid: int) -> None:
    try:
        os.kill(pgid, signal.SIGTERM)  # the leader shuts its children down itself
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _served(path: str, urls: Sequence[str], api_key: str | None) -> bool:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for url in urls:
        try:
            request = urllib.request.Request(url + "/model_info", headers=headers)
            with urllib.request.urlopen(request, timeout=2) as answer:
                if json.loads(answer.read()).get("model_path") == path:
                    return True
        except Exception:  # noqa: BLE001 - a server that is gone or broken serves nothing
            continue
    return False


def _watch(lines) -> tuple[dict, dict]:
    groups: dict[int, None] = {}
    dirs: dict[str, tuple[list[str], str | None]] = {}
    for line in lines:
        message = json.loads(line)
        op = message["op"]
        if op == "guard_group":
            groups[message["pgid"]] = None
        elif op == "release_group":
            groups.pop(message["pgid"], None)
        elif op == "guard_dir":
            dirs[message["path"]] = (message["urls"], message["api_key"])
        elif op == "release_dir":
            dirs.pop(message["path"], None)
    return groups, dirs


def main() -> None:
    """Read registrations until end-of-file (the owner is gone), then clean up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    groups, dirs = _watch(sys.stdin.buffer)
    for pgid in groups:
        _stop_group(pgid)
    for path, (urls, api_key) in dirs.items():
        if not _served(path, urls, api_key):
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
