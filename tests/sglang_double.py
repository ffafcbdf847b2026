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
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
import uuid
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
#: SGLang 0.5.23's answer to ``POST /flush_cache`` (200, plain text) when it flushed.
FLUSHED = (
    b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    b"waiting requests, the operation will not be performed.)\n"
)


def toy_model(prompt: list[int], params: dict, sample: int) -> tuple[list[int], list[float], dict]:
    """Deterministic toy generation: returns ``(output_ids, logprobs, finish_reason)``.

    Token ``t_k = (31 * sum(context) + 7 * sample * (temperature > 0) + k) % 97 + 2``; its log-prob
    is ``-(t_k % 7 + 1) / 8``. Stops on EOS (id 2) or ``stop_token_ids`` (token kept, SGLang's
    ``{"type": "stop", "matched": id}``) unless ``ignore_eos``, else at ``max_new_tokens``.
    """
    context, out, lps = list(prompt), [], []
    stops = set(params.get("stop_token_ids") or ())
    if not params.get("ignore_eos"):
        stops.add(EOS_ID)
    salt = 7 * sample if (params.get("temperature", 1.0) or 0) > 0 else 0
    for k in range(params.get("max_new_tokens", 128)):
        tok = (31 * sum(context) + salt + k) % 97 + 2
        out.append(tok)
        lps.append(-((tok % 7) + 1) / 8)
        context.append(tok)
        if tok in stops:
            return out, lps, {"type": "stop", "matched": tok}
    return out, lps, {"type": "length", "length": len(out)}


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

    def __post_init__(self) -> None:
        self.running.set()

    def sigstop(self) -> None:
        """Answer nothing (every request waits) until :meth:`sigcont`."""
        self.running.clear()

    def sigcont(self) -> None:
        self.running.set()

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
        items = []
        for prompt, p in zip(prompts, per_prompt):
            for j in range(p.get("n", 1) or 1):
                items.append(self._item(prompt, p, j, bool(body.get("return_logprob"))))
        answer = items if (batch or len(items) > 1) else items[0]
        validate_generate_response(answer)  # the double itself must stay on protocol
        return 200, answer

    def _item(self, prompt: list[int], params: dict, sample: int, logprob: bool) -> dict:
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

        def do_GET(self) -> None:
            double.running.wait()
            with double.lock:
                double.requests.append((self.path, None))
            if not self._authorized():
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
                    },
                )
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
            if not self._authorized() or (fault is not None and self._apply(fault)):
                return
            if self.path in double.handlers:
                self._send(*double.handlers[self.path](body))
            elif self.path == "/generate":
                status, answer = double.generate(body)
                if fault is not None and fault.kind == "abort" and status == 200:
                    answer = _abort(answer, fault.message)
                self._send(status, answer)
            elif self.path.split("?")[0] == "/flush_cache":  # SGLang answers in plain text
                self._send(200, FLUSHED)
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
    thread = threading.Thread(
        target=server.serve_forever, args=(0.05,), name="sglang-double", daemon=True
    )
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return double, stop
