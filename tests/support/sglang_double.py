"""A light in-process double of an SGLang 0.5.23 HTTP server, for fast unit tests of the client.

It follows the real protocol exactly where the client touches it, and checks itself against SGLang's
own schema: EVERY ``/generate`` request body is decoded with SGLang's ``GenerateRequest`` (loaded by
file path from the sglang wheel, see ``ar_torchrl.backends.sglang.schema``) and a contract
violation is answered like the server does (HTTP 400, ``{"error": "<JsonContractError text>"}``);
EVERY ``/generate`` answer is decoded with ``GenerateResponse`` before it is sent (a double that
drifted off protocol fails the test). Shapes follow what a real 0.5.23 server returned on this
machine: ``n > 1`` and batches (``input_ids`` a list of lists, ``sampling_params`` one dict or a
list) answer a list; each item has ``text``, ``output_ids`` (stop token included) and
``meta_info`` with ``output_token_logprobs`` (``[[logprob, token_id, null], ...]`` when
``return_logprob``), ``finish_reason`` (``{"type": "length", "length": N}`` or ``{"type": "stop",
"matched": id}``), ``prompt_tokens``, ``completion_tokens``, ``weight_version``.

The "model" is a deterministic toy (see :func:`toy_model`); it is a stand-in for speed only: log-prob
numerics are tested against the real server (``tests/test_sglang_backend.py``, marker ``sglang``).

Faults can be injected per ``/generate`` request (FIFO): an HTTP status with a message, a delay (for
timeouts), a dropped connection (no answer at all), an answer dripped byte by byte, or an abort of
the completions. A handler override may return raw bytes (malformed answers are the one place the
double leaves the protocol on purpose: the client must turn each into a clear error). With
``api_key`` set, every path but ``/health*`` needs ``Authorization: Bearer <api_key>`` and answers
401 ``{"error": "Unauthorized"}`` otherwise, as SGLang's middleware does. :meth:`SGLangDouble.sigstop`
freezes the whole double like a SIGSTOPped server (connections are accepted, nothing is answered,
``/health*`` included) until :meth:`SGLangDouble.sigcont`; the requests it held then go on.

**Requests in flight, abort, pause** (what partial rollouts use), as SGLang 0.5.23 does them: each
answer item's ``meta_info.id`` is its request id (``rid`` of a single request; ``rid[i]`` of a batch,
``f"{rid}_{i}"`` for one string; the samples of ``n > 1`` get random ids). With ``token_delay_s >
0`` the items of a request are decoded together, one token per ``token_delay_s``, and stay in
:attr:`SGLangDouble.in_flight` meanwhile. ``POST /abort_request`` (body checked with SGLang's own
``AbortRequest`` schema; a violation answers 400 ``{"object": "error", "message": ...}``) answers 200
with an empty body at once; the request it names ends after one more token (SGLang's aborted
request still runs one decode pass) and answers 200 with the tokens and log-probs it has and
``finish_reason = {"type": "abort", "message": "Aborted", "status_code": null, "err_type":
null}``; an unknown ``rid`` is ignored, a second abort of the same ``rid`` too (SGLang's
``abort_sent``), ``abort_all`` ends every request. ``lose_aborts = k`` loses the next ``k`` aborts
by ``rid`` the way SGLang does when an abort reaches its scheduler before the request (the request
runs to its end, and later aborts of that ``rid`` are ignored). ``POST /pause_generation``
(``{"mode": "abort" | "retract" | "in_place"}``) answers ``{"message": "Generation paused
successfully.", "status": "ok"}``: ``abort`` ends every request first; new ``/generate`` requests
wait until ``POST /continue_generation``; ``retract``/``in_place`` freeze the running ones.

**Weights and memory** (what the colocated lifecycle uses): :meth:`SGLangDouble.accept_weight_updates`
answers SGLang's weight updates (``/update_weights_from_tensor`` and ``/update_weights_from_disk``:
``{"success": true, ...}``, sessions 404 as older servers), each waiting for the running requests
like SGLang's writer lock (not while paused). With ``versioned`` the toy's tokens and log-probs
depend on ``weight_version``. ``/release_memory_occupation`` and ``/resume_memory_occupation``
(``{"tags": [...]}``, none: ``weights``, ``kv_cache``, ``cuda_graph``; SGLang's api_types has no
schema for them: their fields mirror ``io_struct``'s ``ReleaseMemoryOccupationReqInput`` /
``ResumeMemoryOccupationReqInput``, checked against the installed source by
``tests/backends/sglang/test_sglang_memory.py``) answer 200 ``null``; the memory of released tags leaves
:meth:`SGLangDouble.held_bytes` ``release_lag_s`` after the answer (the early return of slime #579),
resumed weights are garbage until the next update (sglang #6367). Where SGLang 0.5.23's scheduler
dies, the double dies (:meth:`SGLangDouble.crash`: the connection closes without an answer, the
port stops listening, :attr:`SGLangDouble.crashed` says why): a release on ``device="cpu"`` (``Found
no NVIDIA driver``), a release while requests run and the server is not paused (its idle
assertion), a resume of a tag that was not released (``KeyError``), and a second release of a
released tag (not defined by SGLang without a GPU: treated as fatal). ``GET /v1/loads`` reports
``num_running_reqs`` and ``memory`` (``weight_gb``, ``kv_cache_gb``, ``graph_gb``) as 0.5.23 does;
``/server_info`` has ``device`` and ``enable_memory_saver``.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ar_torchrl.backends.sglang.schema import (
    load_api_types,
    validate_generate_request,
    validate_generate_response,
)

EOS_ID = 2
VOCAB = 99
#: SGLang 0.5.23's update answer when the weights loaded but the flush was refused (requests ran).
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)
#: SGLang 0.5.23's answer to ``POST /flush_cache`` (200, plain text) when it flushed.
FLUSHED = (
    b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    b"waiting requests, the operation will not be performed.)\n"
)


def version_salt(version: str | None) -> int:
    """What a weight version adds to the toy's tokens and log-probs (0: the starting weights)."""
    return 0 if version in (None, "default") else zlib.crc32(str(version).encode()) % 89 + 1


def toy_model(
    prompt: list[int], params: dict, sample: int, version: str | None = None
) -> tuple[list[int], list[float], dict]:
    """Deterministic toy generation: returns ``(output_ids, logprobs, finish_reason)``.

    Token ``t_k = (31 * sum(context) + 7 * sample * (temperature > 0) + v + k) % 97 + 2``; its
    log-prob is ``-((t_k + v) % 7 + 1) / 8``, with ``v = version_salt(version)`` (0 unless the
    double is ``versioned``). Stops on EOS (id 2) or ``stop_token_ids`` (token kept, SGLang's
    ``{"type": "stop", "matched": id}``) unless ``ignore_eos``, else at ``max_new_tokens``.
    """
    context, out, lps = list(prompt), [], []
    stops = set(params.get("stop_token_ids") or ())
    if not params.get("ignore_eos"):
        stops.add(EOS_ID)
    v = version_salt(version)
    salt = (7 * sample if (params.get("temperature", 1.0) or 0) > 0 else 0) + v
    for k in range(params.get("max_new_tokens", 128)):
        tok = (31 * sum(context) + salt + k) % 97 + 2
        out.append(tok)
        lps.append(-(((tok + v) % 7) + 1) / 8)
        context.append(tok)
        if tok in stops:
            return out, lps, {"type": "stop", "matched": tok}
    return out, lps, {"type": "length", "length": len(out)}


#: The request fields SGLang 0.5.23 reads from the bodies of the routes without an api_types schema
#: (``io_struct``'s msgspec structs, extra keys ignored); tests/backends/sglang/test_sglang_memory.py checks them
#: against the installed source. ``rid`` and ``http_worker_ipc`` come from ``BaseReq``.
IO_STRUCT_FIELDS = {
    "PauseGenerationReqInput": {"rid", "http_worker_ipc", "mode"},
    "ContinueGenerationReqInput": {"rid", "http_worker_ipc", "torch_empty_cache"},
    "ReleaseMemoryOccupationReqInput": {"rid", "http_worker_ipc", "tags"},
    "ResumeMemoryOccupationReqInput": {"rid", "http_worker_ipc", "tags"},
}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
#: what SGLang's request validation answers a body of the wrong shape (HTTP 400)
_INVALID = "1 validation error: {}"


@dataclass
class _Running:
    """A request being decoded (``token_delay_s > 0``), found by its ``rid``."""

    rid: str
    tokens: int = 0
    aborted: bool = False
    abort_sent: bool = False


@dataclass
class Fault:
    """One injected fault: ``kind`` in ``{"status", "delay", "drop", "drip", "flood", "abort"}``."""

    kind: str
    status: int = 500
    message: str = "injected fault"
    delay_s: float = 0.0
    size: int = 0


@dataclass
class SGLangDouble:
    """The double's state; start it with :func:`serve_double`."""

    model: Callable[[list[int], dict, int], tuple[list[int], list[float], dict]] = toy_model
    weight_version: str = "default"
    model_path: str = "double"  # what /model_info says it serves
    api_key: str | None = None
    context_length: int = 512
    faults: collections.deque = field(default_factory=collections.deque)
    requests: list = field(default_factory=list)  # (path, parsed body) of every request
    handlers: dict = field(default_factory=dict)  # path -> fn(body) -> (status, json) overrides
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    running: threading.Event = field(default_factory=threading.Event)  # cleared: "SIGSTOPped"
    # requests in flight, abort and pause (see the module docstring)
    token_delay_s: float = 0.0
    lose_aborts: int = 0
    in_flight: dict = field(default_factory=dict)  # rid -> _Running
    paused: str | None = None  # the mode of /pause_generation until /continue_generation
    # weights and memory
    versioned: bool = False
    weights_valid: bool = True
    device: str = "cuda"
    enable_memory_saver: bool = True
    memory_gb: dict = field(
        default_factory=lambda: {"weights": 2.0, "kv_cache": 4.0, "cuda_graph": 0.5}
    )
    release_lag_s: float = 0.0
    flushes: int = 0  # cache flushes (an update's own ``flush_cache`` or ``/flush_cache``)
    offloaded: set = field(default_factory=set)  # released tags
    _freed: set = field(default_factory=set)  # released tags whose memory is free by now
    crashed: str | None = None
    _server: Any = None
    _state: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.running.set()

    def sigstop(self) -> None:
        """Answer nothing (every request waits) until :meth:`sigcont`."""
        self.running.clear()

    def sigcont(self) -> None:
        self.running.set()

    def held_bytes(self) -> int:
        """Device memory this server holds (what a fake device probe of a test subtracts)."""
        return int(sum(gb for tag, gb in self.memory_gb.items() if tag not in self._freed) * 2**30)

    def crash(self, reason: str) -> None:
        """Die like the server would: no answer on any connection, the port stops listening."""
        self.crashed = reason
        if self._server is not None:
            server = self._server
            threading.Thread(target=lambda: (server.shutdown(), server.server_close())).start()

    def accept_weight_updates(self, *, fail: bool = False, refuse_flushes: int = 0) -> None:
        """Answer weight updates as SGLang 0.5.23 does (see the module docstring): an update with
        ``flush_cache`` (SGLang's default: true) flushes the cache; ``refuse_flushes = k``: the
        next ``k`` such flushes are refused as when requests of another client run (the weights
        and version are loaded, the call answers 400 with SGLang's message)."""
        refused = [refuse_flushes]

        def update(body: dict) -> tuple[int, dict]:
            if fail:
                return 400, {"success": False, "message": "Failed to update weights: disk full"}
            with self._state:  # SGLang's writer lock waits for the requests in flight
                self._state.wait_for(lambda: not self.in_flight or self.paused is not None)
                if "weight_version" in body:
                    self.weight_version = str(body["weight_version"])
                self.weights_valid = True
                if body.get("flush_cache", True):
                    if refused[0]:
                        refused[0] -= 1
                        return 400, {"success": False, "message": NOT_FLUSHED}
                    self.flushes += 1
            return 200, {"success": True, "message": "Success", "num_paused_requests": 0}

        self.handlers.update(
            {
                "/begin_weight_update": lambda body: (404, {"detail": "Not Found"}),
                "/end_weight_update": lambda body: (404, {"detail": "Not Found"}),
                "/update_weights_from_tensor": update,
                "/update_weights_from_disk": update,
            }
        )

    def inject(self, kind: str, **kwargs: Any) -> None:
        self.faults.append(Fault(kind, **kwargs))

    def generate_bodies(self) -> list[dict]:
        return [body for path, body in self.requests if path == "/generate"]

    # -- protocol ------------------------------------------------------------------------------

    def generate(self, body: dict) -> tuple[int, Any]:
        """Answer a parsed ``/generate`` body like SGLang 0.5.23 (status, JSON)."""
        api = load_api_types()
        try:
            validate_generate_request(body)
        except api.JsonContractError as exc:
            return 400, {"error": str(exc)}
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        params = body.get("sampling_params") or {}
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        rid = body.get("rid")
        with self._state:  # SGLang holds new requests while paused
            self._state.wait_for(lambda: self.paused is None)
            version = self.weight_version if self.weights_valid else "released-garbage"
        items, rids = [], []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            n = p.get("n", 1) or 1
            for j in range(n):
                if n > 1 or rid is None:  # SGLang gives the samples of n > 1 ids of its own
                    rids.append(uuid.uuid4().hex)
                elif batch:
                    rids.append(rid[i] if isinstance(rid, list) else f"{rid}_{i}")
                else:
                    rids.append(rid)
                items.append(self._item(prompt, p, j, bool(body.get("return_logprob")), version))
        if self.token_delay_s > 0:
            self._decode(items, rids)
        for item, item_rid in zip(items, rids):
            item["meta_info"]["id"] = item_rid
        answer = items if (batch or len(items) > 1) else items[0]
        validate_generate_response(answer)  # the double itself must stay on protocol
        return 200, answer

    def _decode(self, items: list[dict], rids: list[str]) -> None:
        """Reveal the items' tokens together, one per ``token_delay_s``; an aborted one stops
        after one more token with SGLang's abort answer."""
        states = [_Running(r) for r in rids]
        with self._state:
            self.in_flight.update({r.rid: r for r in states})
        try:
            left = {k: len(item["output_ids"]) for k, item in enumerate(items)}
            stop_after: dict[int, int] = {}
            while left:
                time.sleep(self.token_delay_s)
                with self._state:
                    self._state.wait_for(lambda: self.paused in (None, "abort"))
                    for k in list(left):
                        state = states[k]
                        state.tokens += 1
                        if state.aborted and k not in stop_after:
                            stop_after[k] = state.tokens  # one more decode pass, then it ends
                        if state.tokens >= left[k] or state.tokens == stop_after.get(k):
                            if state.tokens < left[k]:
                                _cut(items[k], state.tokens)
                            del left[k]
                            self.in_flight.pop(state.rid, None)
                            self._state.notify_all()
        finally:
            with self._state:
                for state in states:
                    self.in_flight.pop(state.rid, None)
                self._state.notify_all()

    def abort(self, body: Any) -> tuple[int, Any]:
        """``POST /abort_request`` as SGLang 0.5.23 answers it (see the module docstring)."""
        api = load_api_types()
        try:
            req = api.AbortRequest.from_json_value(body)
        except api.JsonContractError as exc:
            return 400, {"object": "error", "message": _INVALID.format(exc)}
        with self._state:
            if req.abort_all:
                targets = list(self.in_flight.values())
            else:
                state = self.in_flight.get(req.rid)
                targets = [] if state is None or state.abort_sent else [state]
                if state is not None:
                    state.abort_sent = True
                if targets and self.lose_aborts > 0:  # reached the scheduler before the request
                    self.lose_aborts -= 1
                    targets = []
            for state in targets:
                state.aborted = True
        return 200, b""

    def pause(self, body: Any) -> tuple[int, Any]:
        mode = (body or {}).get("mode", "abort") if isinstance(body, dict) else None
        if mode not in ("abort", "retract", "in_place"):
            return 400, {"object": "error", "message": _INVALID.format(f"mode: {mode!r}")}
        with self._state:
            self.paused = mode
            if mode == "abort":  # SGLang aborts everything and waits until nothing runs
                for state in self.in_flight.values():
                    state.aborted = True
                self._state.wait_for(lambda: not self.in_flight)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def resume_generation(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("torch_empty_cache", True), bool):
            return 400, {"object": "error", "message": _INVALID.format(body)}
        with self._state:
            self.paused = None
            self._state.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def memory(self, path: str, body: Any) -> tuple[int, Any] | None:
        """``/release_memory_occupation`` / ``/resume_memory_occupation``; ``None``: crashed."""
        tags = body.get("tags") if isinstance(body, dict) else None
        if tags is not None and not (
            isinstance(tags, list) and all(isinstance(t, str) for t in tags)
        ):
            return 400, {"object": "error", "message": _INVALID.format(f"tags: {tags!r}")}
        tags = tags or list(MEMORY_TAGS)
        with self._state:
            if path == "/release_memory_occupation":
                if self.device == "cpu":
                    self.crash(
                        "RuntimeError: Found no NVIDIA driver on your system (release on a CPU "
                        "server)"
                    )
                    return None
                if self.in_flight and self.paused in (None, "abort"):
                    self.crash(
                        "AssertionError: release_memory_occupation should be called only when "
                        "server is idle."
                    )
                    return None
                if set(tags) & self.offloaded:
                    self.crash(f"released twice: {sorted(set(tags) & self.offloaded)}")
                    return None
                self.offloaded |= set(tags)
                if "weights" in tags:
                    self.weights_valid = False  # SGLang frees them: garbage after the resume
                if self.enable_memory_saver:
                    freed = set(tags) & set(self.memory_gb)
                    if self.release_lag_s > 0:  # the answer comes before the memory is free
                        timer = threading.Timer(self.release_lag_s, self._free, (freed,))
                        timer.daemon = True
                        timer.start()
                    else:
                        self._freed |= freed
                return 200, None
            missing = [t for t in tags if t not in self.offloaded]
            if missing:
                self.crash(f"KeyError: {missing[0]!r} (resume of a tag that was not released)")
                return None
            self.offloaded -= set(tags)
            self._freed -= set(tags)
            return 200, None

    def _free(self, tags: set) -> None:
        with self._state:
            self._freed |= tags & self.offloaded

    def loads(self) -> dict:
        """``GET /v1/loads`` (the fields the client reads, as 0.5.23 names them)."""
        with self._state:
            running = len(self.in_flight)
        memory = {
            "weight_gb": self.memory_gb.get("weights", 0.0),
            "kv_cache_gb": self.memory_gb.get("kv_cache", 0.0),
            "graph_gb": self.memory_gb.get("cuda_graph", 0.0),
            "token_capacity": 4096,
        }
        load = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0, "memory": memory}
        return {"version": "0.5.23", "num_accelerators": 1, "loads": [load]}

    def _item(
        self, prompt: list[int], params: dict, sample: int, logprob: bool, version: str | None
    ) -> dict:
        if self.versioned:
            out, lps, finish = self.model(prompt, params, sample, version)
        else:
            out, lps, finish = self.model(prompt, params, sample)
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "weight_version": self.weight_version,
            "completion_tokens": len(out),
            "cached_tokens": 0,
        }
        if logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(out, lps)]
        return {"text": "", "output_ids": out, "meta_info": meta}


def _cut(item: dict, keep: int) -> None:
    """An item aborted after ``keep`` tokens: SGLang's answer to an aborted request."""
    meta = item["meta_info"]
    item["output_ids"] = item["output_ids"][:keep]
    meta["completion_tokens"] = keep
    if "output_token_logprobs" in meta:
        meta["output_token_logprobs"] = meta["output_token_logprobs"][:keep]
    meta["finish_reason"] = dict(ABORTED)


def _abort(answer: Any, message: str) -> Any:
    items = answer if isinstance(answer, list) else [answer]
    for item in items:
        item["meta_info"]["finish_reason"] = {"type": "abort", "message": message}
    return answer


def _make_handler(double: SGLangDouble) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

        def _send(self, status: int, payload: Any) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if double.api_key is None or self.path.startswith("/health"):
                return True
            if self.headers.get("Authorization") == f"Bearer {double.api_key}":
                return True
            self._send(401, {"error": "Unauthorized"})
            return False

        def _dead(self) -> bool:
            """A crashed double answers nothing (the connection just closes)."""
            if double.crashed is None:
                return False
            self.close_connection = True
            return True

        def do_GET(self) -> None:
            double.running.wait()
            with double.lock:
                double.requests.append((self.path, None))
            if self._dead() or not self._authorized():
                return
            info = {"model_path": double.model_path, "weight_version": double.weight_version}
            if self.path in ("/health", "/health_generate"):
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/model_info":
                self._send(200, info)
            elif self.path == "/server_info":
                self._send(
                    200,
                    {
                        **info,
                        "tp_size": 1,
                        "dp_size": 1,
                        "dtype": "float32",
                        "context_length": double.context_length,
                        "device": double.device,
                        "enable_memory_saver": double.enable_memory_saver,
                        "version": "0.5.23",
                    },
                )
            elif self.path == "/v1/loads":
                self._send(200, double.loads())
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            double.running.wait()
            body = json.loads(
                self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null"
            )
            with double.lock:
                double.requests.append((self.path, body))
                fault = (
                    double.faults.popleft() if double.faults and self.path == "/generate" else None
                )
            if self._dead() or not self._authorized():
                return
            if fault is not None and self._apply(fault):
                return
            path, _, query = self.path.partition("?")
            if self.path in double.handlers:
                self._send(*double.handlers[self.path](body))
            elif self.path == "/generate":
                status, answer = double.generate(body)
                if fault is not None and fault.kind == "abort" and status == 200:
                    answer = _abort(answer, fault.message)
                self._send(status, answer)
            elif path == "/flush_cache":  # SGLang answers in plain text, once idle
                timeout = float(query.partition("timeout=")[2] or 0)
                with double._state:
                    idle = double._state.wait_for(lambda: not double.in_flight, timeout)
                if idle:
                    double.flushes += 1
                    self._send(200, FLUSHED)
                else:
                    self._send(400, b"Flush cache failed.\n")
            elif self.path == "/abort_request":
                self._send(*double.abort(body))
            elif self.path == "/pause_generation":
                self._send(*double.pause(body))
            elif self.path == "/continue_generation":
                self._send(*double.resume_generation(body))
            elif self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                answer = double.memory(self.path, body)
                if answer is None:  # the scheduler died: no answer
                    self.close_connection = True
                    return
                self._send(*answer)
            else:
                self._send(404, {"detail": "Not Found"})

        def _apply(self, fault: Fault) -> bool:
            """Apply a fault; True when the request is fully handled."""
            if fault.kind == "status":
                self._send(fault.status, {"error": {"message": fault.message}})
                return True
            if fault.kind == "delay":
                time.sleep(fault.delay_s)
            if fault.kind == "drop":
                self.close_connection = True
                self.connection.close()
                return True
            if fault.kind == "drip":  # a valid-looking answer, one byte every delay_s
                data = b'{"text": "dripping"}' * 4
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                for i in range(len(data)):
                    try:
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                    except OSError:  # the client gave up
                        break
                    time.sleep(fault.delay_s)
                self.close_connection = True
                return True
            if fault.kind == "flood":  # no Content-Length: the body ends when the connection does
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    self.wfile.write(b"[" + b"0," * (fault.size // 2) + b"0]")
                except OSError:
                    pass
                self.close_connection = True
                return True
            return False

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that gave up (timeout tests) is not an error of the double."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def serve_double(double: SGLangDouble | None = None):
    """Start the double on a free loopback port in a daemon thread; returns ``(double, stop)``."""
    double = double or SGLangDouble()
    server = _Server(("127.0.0.1", 0), _make_handler(double))
    double.url = f"http://127.0.0.1:{server.server_address[1]}"
    double._server = server
    thread = threading.Thread(
        target=server.serve_forever, args=(0.05,), name="sglang-double", daemon=True
    )
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return double, stop
