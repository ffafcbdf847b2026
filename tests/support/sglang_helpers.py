"""Helpers of the SGLang tests (the fixtures themselves live in ``conftest.py``)."""

from __future__ import annotations

import base64
import contextlib
import io
import ipaddress
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.sglang.schema import (
    SchemaNotFoundError,
    default_sglang_venv,
    find_api_types,
)

ROOT = Path(__file__).resolve().parents[2]
FAST_TIER = os.environ.get("AR_TORCHRL_TESTS") == "fast"
PROMPTS = [[1, 40, 41, 42], [1, 50, 51]]


def require_sglang_venv() -> Path:
    """The server venv's python, or ``pytest.fail`` with the command that creates it."""
    python = default_sglang_venv() / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"SGLang server venv not found ({python}). Run `bash scripts/setup_sglang_env.sh` "
            "(or set AR_TORCHRL_SGLANG_VENV) before the SGLang tests.",
            pytrace=False,
        )
    return python


def require_schema() -> None:
    """SGLang's msgspec schema (for the double): skip in the fast tier when absent, else fail."""
    try:
        find_api_types()
    except SchemaNotFoundError as err:
        if FAST_TIER:
            pytest.skip(f"fast tier without .venv-sglang: {err}")
        pytest.fail(str(err), pytrace=False)


def trainer_log_probs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0):
    """The trainer's fp32 ``log_softmax(logits / T)`` of ``tokens`` after ``prompt``: ``[len(tokens)]``."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(
        -1, torch.tensor(tokens)[:, None]
    )[:, 0]


def trainer_with_value_head(seed: int) -> torch.nn.Module:
    """Tiny Qwen3 (seed 0) + value head, every tensor perturbed by ``0.1 * N(0, 1)`` (``seed``)."""
    from ar_torchrl.models.tiny import build_tiny_qwen3
    from ar_torchrl.modules import attach_value_head

    torch.set_num_threads(1)
    model = attach_value_head(build_tiny_qwen3(99, seed=0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def assert_server_matches(backend, model, version: int, prompts=PROMPTS) -> None:
    """Greedy and T=0.8 log-probs of the server(s) equal the trainer's fp32 log_softmax to 1e-4."""
    for sampling in (
        SamplingParams(max_new_tokens=8, temperature=0.0),
        SamplingParams(max_new_tokens=8, temperature=0.8),
    ):
        out = backend.generate(prompts, n=2, sampling=sampling)
        assert {c.policy_version for c in out} == {version}
        assert {c.meta["server_weight_version"] for c in out} == {str(version)}
        for c in out:
            ref = trainer_log_probs(
                model, prompts[c.prompt_index], c.token_ids, sampling.temperature or 1.0
            )
            torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-4, rtol=0)


class _NoTensors(pickle.Unpickler):
    """Reads a tensor payload without opening its shared memory: each pickle carries exactly one
    reference for its server, and a reader that rebuilt the tensor would spend it."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.multiprocessing"):
            return lambda *args, **kwargs: None
        return super().find_class(module, name)


def metadata_only(serialized: str) -> dict:
    """The payload of ``/update_weights_from_tensor`` with its tensor left out (``None``)."""
    return _NoTensors(io.BytesIO(base64.b64decode(serialized))).load()


class SentNames:
    """Records the tensor names every weight-sync request carries, by wrapping the HTTP session.

    The payload is decoded while the request is in flight (the temp dir and the shared-memory
    tensors still exist): safetensors shards (disk), the pickled bucket's metadata (tensor), or the
    ``names`` field (distributed).
    """

    def __init__(self, backend) -> None:
        self.names: list[str] = []
        self.paths: list[str] = []
        session, inner = backend.session, backend.session.request

        def request(method, url, json=None, **kw):
            path = "/" + url.split("/", 3)[3]
            if method == "POST":
                self.paths.append(path)
                self.names += self._decode(path, json)
            return inner(method, url, json=json, **kw)

        session.request = request

    @staticmethod
    def _decode(path: str, body: dict) -> list[str]:
        if path == "/update_weights_from_disk":
            names = []
            for f in sorted(Path(body["model_path"]).glob("*.safetensors")):
                with safe_open(str(f), "pt") as sf:
                    names += list(sf.keys())
            return names
        if path == "/update_weights_from_tensor":
            return [
                m.name
                for m in pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))[
                    "metadata"
                ]
            ]
        if path == "/update_weights_from_distributed":
            return list(body["names"])
        return []


def alive(pid: int) -> bool:
    """Is ``pid`` a running (non-zombie) process?"""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def group_pids(pgid: int) -> list[int]:
    """Running (non-zombie) processes of process group ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def wait_until(predicate, timeout_s: float, poll_s: float = 0.1) -> float:
    """Seconds until ``predicate()`` held (``inf`` if it never did within ``timeout_s``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(poll_s)
    return float("inf")


def listening_addresses(port: int) -> list[str]:
    """Local addresses with a socket listening on TCP ``port`` (``/proc/net/tcp`` and ``tcp6``)."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hexport = fields[1].split(":")
            if fields[3] == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                if width == 8:
                    found.append(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
                else:
                    found.append("::" if int(address, 16) == 0 else f"ipv6:{address}")
    return found


def listening_sockets(pids) -> list[tuple[str, int]]:
    """``(address, port)`` of the TCP sockets in LISTEN state that processes ``pids`` hold open
    (their fds matched by inode in ``/proc/net/tcp`` and ``tcp6``; ``::`` and ``0.0.0.0`` are the
    wildcard addresses)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hexport = fields[1].split(":")
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(raw)), int(hexport, 16)))
    return found


def mapped_files(pids, prefix: str) -> set[str]:
    """Paths starting with ``prefix`` that processes ``pids`` have mapped (``/proc/<pid>/maps``)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(prefix):
                    found.add(fields[5].removesuffix(" (deleted)"))
    return found


def children_named(ppid: int, comm: str) -> list[int]:
    """Running children of ``ppid`` whose command name (``/proc/<pid>/comm``) is ``comm``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == ppid and (entry / "comm").read_text().strip() == comm:
                    out.append(int(entry.name))
    return out


class ParentServer:
    """A real SGLang server launched by a separate "trainer" process (``tests/support/sglang_parent.py``).

    Killing that process (any signal) must take the server and its weight dirs with it.
    """

    def __init__(self, model_dir: Path, log: Path, *, sync: bool = False) -> None:
        python = require_sglang_venv()
        cmd = [
            sys.executable,
            str(ROOT / "tests" / "support" / "sglang_parent.py"),
            str(model_dir),
            str(log),
            str(python),
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        self.parent = subprocess.Popen(
            cmd + (["--sync"] if sync else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        line = self.parent.stdout.readline()
        if not line:
            self.parent.wait(30)
            raise RuntimeError(f"the server parent exited ({self.parent.returncode}); log {log}")
        info = json.loads(line)
        self.log = log
        self.url, self.pid, self.dirs = info["url"], info["pid"], [Path(d) for d in info["dirs"]]
        self.owned, self.trainer_log = Path(info["owned"]), Path(info["trainer_log"])

    def alive(self) -> bool:
        return self.parent.poll() is None and alive(self.pid)

    def kill_parent(self, sig: int) -> None:
        os.kill(self.parent.pid, sig)
        self.parent.wait(30)

    def close(self) -> None:
        """Ask the parent to stop its server cleanly (end of its stdin), else kill it."""
        if self.parent.poll() is None:
            self.parent.stdin.close()
            try:
                self.parent.wait(60)
            except subprocess.TimeoutExpired:
                self.kill_parent(signal.SIGKILL)


#: ``SGLangBackend``'s own arguments; every other keyword of :func:`sglang_backend` is a client option
_CONNECTION = ("router_url", "weight_sync", "weight_sync_options")


def sglang_backend(urls, **kw):
    """``SGLangBackend(urls, <router_url, weight_sync...>, options=SGLangClientOptions(<the rest>))``
    with the tests' defaults: quick retries, no progress bar."""
    from ar_torchrl.backends.sglang import SGLangBackend, SGLangClientOptions

    own = {k: kw.pop(k) for k in _CONNECTION if k in kw}
    options = {"backoff_s": 0.01, "show_progress": False, **kw}
    return SGLangBackend(urls, options=SGLangClientOptions(**options), **own)
