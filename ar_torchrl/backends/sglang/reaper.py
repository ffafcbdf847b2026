"""Nothing this process starts may outlive it: a watchdog that cleans up when this process dies.

A launched SGLang server (~3 GB of RAM here, GPU memory on a GPU node) and the weight directories
of disk syncs must not survive their trainer, whatever ends it: an exception, SIGTERM, SIGHUP, or
SIGKILL (which runs no ``finally`` and no ``atexit``). The first registration starts one small
watchdog process (this file run as a script, standard library only, in its own session so that a
signal to the trainer's process group does not reach it). It reads registrations from a pipe whose
write end only this process holds; when this process dies for any reason the kernel closes the
pipe, the watchdog reads end-of-file and

- stops every registered process group: SIGTERM to its leader, SIGKILL to the whole group after a
  short grace period (a few seconds in all), then unlinks the ``/dev/shm`` files its processes had
  mapped whose names start with the prefixes given at registration (SGLang's
  ``sglang_loads_*.shm``, which SGLang never removes itself);
- removes every registered directory (or file), except a directory that a live server still
  reports as its ``model_path`` (a shared server keeps serving it; its next client reads the
  config from there);
- stops every registered ``torch_shm_manager`` (the daemon torch starts for the ``file_system``
  sharing strategy, see :mod:`~ar_torchrl.backends.sglang.senders.tensor`): a server that ever
  received a tensor from this process keeps a connection to it, so it would live as long as the
  servers; it gets a few seconds to exit by itself (it does once no client is left, unlinking the
  segments it tracks), else SIGTERM; then its socket directory and any ``/dev/shm/torch_<pid>_*``
  segment of this process left behind are removed.

Registrations are released on a clean stop (the launcher stops its server itself). A child made by
``os.fork`` does not keep the pipe open (it is closed in the child).
"""

from __future__ import annotations

import contextlib
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

__all__ = [
    "guard_dir",
    "guard_process_group",
    "guard_shm_manager",
    "mapped_shm_files",
    "release_dir",
    "release_process_group",
    "remove_path",
]

GRACE_S = 3.0
SHM_DIR = "/dev/shm"
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


def guard_process_group(pgid: int, shm_prefixes: Sequence[str] = ()) -> None:
    """Stop process group ``pgid`` (a server started with ``start_new_session``) if this process dies.

    Files in ``/dev/shm`` that the group's processes have mapped when it is stopped, and whose
    names start with one of ``shm_prefixes``, are unlinked after it stopped.

    Example:
        >>> proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
        >>> guard_process_group(proc.pid); release_process_group(proc.pid); proc.kill()
    """
    _send({"op": "guard_group", "pgid": int(pgid), "shm_prefixes": list(shm_prefixes)})


def release_process_group(pgid: int) -> None:
    """Forget ``pgid`` (it was stopped cleanly)."""
    _send({"op": "release_group", "pgid": int(pgid)})


def guard_dir(path: str | Path, urls: Sequence[str] = (), api_key: str | None = None) -> None:
    """Remove ``path`` (a directory or a file) when this process dies, unless a server in ``urls``
    still serves it (reports it as its ``model_path``).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(prefix="ar_torchrl-doc-")
        >>> guard_dir(d); release_dir(d); os.rmdir(d)
    """
    _send({"op": "guard_dir", "path": str(path), "urls": list(urls), "api_key": api_key})


def release_dir(path: str | Path) -> None:
    """Forget ``path`` (it was removed, or it is no longer this process's to remove)."""
    _send({"op": "release_dir", "path": str(path)})


def guard_shm_manager(pid: int, socket_dir: str | Path | None = None) -> None:
    """Stop this process's ``torch_shm_manager`` (``pid``) after this process died, once the
    guarded process groups are stopped; then remove ``socket_dir`` and this process's leftover
    ``/dev/shm/torch_<pid>_*`` segments.

    Example:
        >>> guard_shm_manager(2**22 + 1)  # a pid that does not run: nothing to stop at exit
    """
    _send(
        {
            "op": "guard_manager",
            "pid": int(pid),
            "owner": os.getpid(),
            "socket_dir": socket_dir and str(socket_dir),
        }
    )


def remove_path(path: str | Path) -> None:
    """Remove a directory tree or a file; a missing path is fine.

    Example:
        >>> remove_path("/nonexistent/ar_torchrl-x")
    """
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def mapped_shm_files(pgid: int, prefixes: Sequence[str]) -> list[str]:
    """Files under ``/dev/shm`` named ``<prefix>*`` that processes of group ``pgid`` have mapped.

    Example:
        >>> mapped_shm_files(os.getpgid(0), ["ar_torchrl-none-"])
        []
    """
    if not prefixes or not Path("/proc").is_dir():
        return []
    found: set[str] = set()
    for pid in _group_pids(pgid):
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            path = fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
            head, _, name = path.rpartition("/")
            if head == SHM_DIR and name.startswith(tuple(prefixes)):
                found.add(path)
    return sorted(found)


# ------------------------------------------------------------------------- the watchdog process
def _stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, ... (``None``: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _group_pids(pgid: int) -> list[int]:
    """The non-zombie processes of group ``pgid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry.name)
            if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def _group_alive(pgid: int) -> bool:
    """Is any non-zombie process left in group ``pgid``?"""
    if not Path("/proc").is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    return bool(_group_pids(pgid))


def _alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _stop_group(pgid: int, shm_prefixes: Sequence[str] = ()) -> None:
    shm = mapped_shm_files(pgid, shm_prefixes)
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
    for path in shm:
        remove_path(path)


def _stop_manager(pid: int, owner: int, socket_dir: str | None) -> None:
    """Let a ``torch_shm_manager`` exit by itself (no client left), else SIGTERM it; then remove
    what it would have removed."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid) and _is_shm_manager(pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    if socket_dir:
        remove_path(socket_dir)
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(f"torch_{owner}_"):
            remove_path(os.path.join(SHM_DIR, name))


def _is_shm_manager(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "torch_shm_manag"
    except OSError:
        return False


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


def _watch(lines) -> tuple[dict, dict, dict]:
    groups: dict[int, list[str]] = {}
    dirs: dict[str, tuple[list[str], str | None]] = {}
    managers: dict[int, tuple[int, str | None]] = {}
    for line in lines:
        message = json.loads(line)
        op = message["op"]
        if op == "guard_group":
            groups[message["pgid"]] = message.get("shm_prefixes", [])
        elif op == "release_group":
            groups.pop(message["pgid"], None)
        elif op == "guard_dir":
            dirs[message["path"]] = (message["urls"], message["api_key"])
        elif op == "release_dir":
            dirs.pop(message["path"], None)
        elif op == "guard_manager":
            managers[message["pid"]] = (message["owner"], message["socket_dir"])
    return groups, dirs, managers


def main() -> None:
    """Read registrations until end-of-file (the owner is gone), then clean up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    groups, dirs, managers = _watch(sys.stdin.buffer)
    for pgid, shm_prefixes in groups.items():
        _stop_group(pgid, shm_prefixes)
    for path, (urls, api_key) in dirs.items():
        if not _served(path, urls, api_key):
            remove_path(path)
    for pid, (owner, socket_dir) in managers.items():
        _stop_manager(pid, owner, socket_dir)


if __name__ == "__main__":
    main()
