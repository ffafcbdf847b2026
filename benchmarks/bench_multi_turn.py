"""Benchmark: a K-turn episode vs one generation of the same total length, per engine.

What it measures (issues 18, 31): for each engine in ``--backends`` and each ``K`` in ``--ks``
(default 1, 2, 4, 8), the wall time of one batch of ``B`` episodes (``--batch``, default 16) that
each generate ``T`` tokens in all (``--total-tokens``, default 96):

* ``K = 1``: one ``backend.generate(prompts, 1, SamplingParams(max_new_tokens=T))``;
* ``K > 1``: ``K`` sequential ``generate`` calls with ``max_new_tokens = T // K``, each continuing
  every episode from its exact ids so far: the prompt, every earlier turn as sampled and, after
  each turn, a tool answer as the chat template's delta
  (``tool_delta_ids(tokenizer, ["42"], include_end_of_turn=True)``: the turns end at their token
  cap, so the end-of-turn token is inserted, as ``ToolEnv`` does for a turn that did not sample
  it). This is what :class:`~ar_torchrl.envs.ToolEnv` sends per turn (``_turn`` /
  ``_after_turn``), without parsing or running a tool.

Engines: ``trainside`` is ``TransformersBackend`` as ``ToolEnv`` drives it, each episode keeping
its KV cache between turns (``generate(..., episodes=EpisodeCache(), episode_ids=...)``: a turn
forwards only the previous turn's last token and the tool delta); ``trainside_prefill`` is the
same engine re-prefilling the whole context every turn (``ToolEnv(kv_cache=False)``, and every
turn before issue 31); ``sglang`` a real server over HTTP. ``one_loop`` is not an engine but a
bound: the forwards of the trainside K-turn episode (the prompt, then one token per step, and at
each turn boundary the turn's last token with the tool delta) done in **one** decode loop over
**one** preallocated cache of the whole episode (:func:`one_loop_episodes`): no ``generate``
call per turn, no kept state moved, nothing dropped. It draws the same tokens as ``trainside``
(seeded per turn alike; tested), so ``x one loop`` (a ``trainside`` row's time over the bound's
in the same repetition) is what the turns cost the engine beyond the forwards themselves, and the
bound's own ratio is the least any engine doing those forwards could reach. It needs prompts of
one length and EOS off (the default).

The headline is the **ratio** ``time(K turns) / time(1 generation)`` per engine: the median over
``--reps`` repetitions of the ratio of the two times measured in the same repetition (the configs
run round-robin, the order of the ``K`` rotated each repetition, after one warm-up batch per
config), with its [min, max] over the repetitions. Both sides generate exactly the same number of
tokens, so ``ratio - 1`` is the relative cost of splitting an episode into turns: per call, the
context that is prefilled (all of it for ``trainside_prefill``; what the cache does not hold
otherwise), a new KV cache, the call itself (for SGLang an HTTP round trip per request and the
scheduler picking the requests up), plus the (K - 1) tool deltas of context (forwarded, and
attended to by every later token). ``x same context`` separates the last from the rest: the
same K-turn time over one generation of ``T`` tokens whose prompt already holds the ``K - 1``
tool answers (the episode's final context length), measured in the same repetition: what the
turns themselves cost (calls, per-turn prefill forwards, cache handling) beyond the longer
context the tool answers add, which one long generation of that context pays too. ``prefill s`` is the wall time of the trainside prefill
forwards (the first forward of each call), timed by forward hooks on its model. ``cached`` is,
for ``trainside``, the context tokens taken from the kept cache
(:attr:`~ar_torchrl.backends.EpisodeCache.reused_tokens`) and, for SGLang, the sum of
``meta_info.cached_tokens`` over the requests (read from the raw ``/generate`` answers by
wrapping the backend's HTTP session, since :class:`~ar_torchrl.backends.Completion` does not
carry it); ``prefilled = submitted - cached``. The SGLang radix cache is flushed (``POST
/flush_cache``) before every measured batch, so each batch starts cold and only reuses what it
wrote itself (never a previous repetition's identical turns); it still shares the common start of
the prompts across episodes, also at ``K = 1``.

Equal lengths: a random tiny model samples its EOS early and at random, which would make ``K``
turns generate fewer or more tokens than one generation. Every turn is made to run to its cap
instead, with the same weights on both backends: EOS is switched off as a stop token
(trainside ``TransformersBackend(eos_token_id=())``, SGLang ``sampling_params.ignore_eos``), and
the script checks that every completion has exactly ``max_new_tokens`` tokens, so every episode
generates exactly ``T`` tokens on both backends (``--allow-eos`` keeps EOS as a stop: then the
lengths differ and the table shows by how much). Editing the model instead (a very negative EOS
logit) is not clean here: Qwen3's ``lm_head`` has no bias and is tied to the input embedding, so
no change of the EOS row makes its logit low for every hidden state, and it would also change the
embedding of the ``<|im_end|>`` tokens of every prompt. The model can still sample the EOS id
mid-turn; the cost of a step does not depend on the token. Both backends get the same prompts,
the same ``SamplingParams`` (temperature 1, seed per repetition and turn) and the same weights
(the trainer's model is synced into the server before timing, also into a server given by
``--url``); SGLang honours ``sampling_seed`` only under ``--enable-deterministic-inference``, so
its tokens differ from the trainside ones, their number does not.

Model and setting: ``build_tiny_qwen3(len(tok), seed)`` (h64, 2 layers, fp32) with the char
tokenizer (``build_char_tokenizer``), ChatML prompts of one-digit additions (all of one length:
no padding), temperature 1, 1 torch thread (``--threads``) in this process; a launched server
inherits ``OMP_NUM_THREADS`` (set it to 1 on a shared machine). Timings are wall times of whole
batches (``time.perf_counter``).

Run (from the repository root):
    .venv/bin/python benchmarks/bench_multi_turn.py --backends trainside,trainside_prefill,one_loop
    .venv/bin/python benchmarks/bench_multi_turn.py --launch            # all, launches a server
    .venv/bin/python benchmarks/bench_multi_turn.py --url http://127.0.0.1:30000
    .venv/bin/python benchmarks/bench_multi_turn.py --quick --backends trainside   # seconds

``--launch`` saves the model with ``save_tiny_model`` (as the tests' ``sglang_model_dir``) and
starts ``launch_sglang_server`` from ``.venv-sglang`` (``$AR_TORCHRL_SGLANG_VENV``); the server is
stopped when the script ends, also on an error. Prints a table and writes
``benchmarks/results/bench_multi_turn[_quick].json`` (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _common import code_version, machine_info, write_json

from ar_torchrl.backends import EpisodeCache, SamplingParams, TransformersBackend
from ar_torchrl.models import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.models.tiny import save_tiny_model
from ar_torchrl.tools.template import render_ids, tool_delta_ids

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BACKENDS = ("trainside", "trainside_prefill", "one_loop", "sglang")
TOOL_ANSWER = "42"
#: the launched server's KV pool: room for B episodes of the longest K plus the radix cache
LAUNCH_ARGS = ("--max-total-tokens", "16384")


# ----------------------------------------------------------------------------- setting
#: the model's positions: an episode's final context must fit
MAX_POSITIONS = 1024
#: the system message ``--system-chars`` repeats (and cuts) to lengthen every prompt
SYSTEM_FILLER = "You are a careful assistant with a calculator tool; check every step. "


def make_prompts(tok, batch: int, seed: int, system_chars: int = 0) -> list[list[int]]:
    """``batch`` ChatML prompts ``What is a + b? ...`` (one-digit a, b: all of one length), led
    by a system message of ``system_chars`` characters when it is > 0 (a longer shared context
    against the same tool answers: with the char tokenizer one token per character).

    Example:
        >>> tok = build_char_tokenizer()
        >>> short, long = make_prompts(tok, 2, 0), make_prompts(tok, 2, 0, system_chars=100)
        >>> len({len(p) for p in long}), len(long[0]) - len(short[0]) > 100
        (1, True)
    """
    gen = torch.Generator().manual_seed(seed)
    system = (SYSTEM_FILLER * (system_chars // len(SYSTEM_FILLER) + 1))[:system_chars]
    prompts = []
    for _ in range(batch):
        a, b = torch.randint(0, 10, (2,), generator=gen).tolist()
        question = f"What is {a} + {b}? Use the calculator, then end with a line Answer: $Answer"
        messages = [{"role": "user", "content": question}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        prompts.append(render_ids(tok, messages, add_generation_prompt=True))
    return prompts


class CachedTokens:
    """Sums SGLang's ``meta_info.cached_tokens`` / ``prompt_tokens`` of every ``/generate`` answer,
    by wrapping the backend's HTTP session (``SGLangBackend.session``, meant to be wrapped).

    The client reads answers with ``response.raw.read1``; the wrapper reads the whole body first,
    records it and hands the client a replay of the same bytes (the connection is released when
    the client closes the response). Thread-safe: the backend sends requests from a thread pool.
    """

    def __init__(self, backend) -> None:
        self.cached = self.prompt = self.items = 0
        self._lock = threading.Lock()
        session, inner = backend.session, backend.session.request

        def request(method, url, *args, **kwargs):
            response = inner(method, url, *args, **kwargs)
            if method == "POST" and url.endswith("/generate") and response.status_code == 200:
                data = response.raw.read(decode_content=True)
                self._record(json.loads(data))
                response.raw = _Replay(data, response.raw)
            return response

        session.request = request

    def _record(self, answer: Any) -> None:
        items = answer if isinstance(answer, list) else [answer]
        metas = [item.get("meta_info", {}) for item in items]
        with self._lock:
            self.items += len(metas)
            self.cached += sum(int(m.get("cached_tokens", 0)) for m in metas)
            self.prompt += sum(int(m.get("prompt_tokens", 0)) for m in metas)

    def reset(self) -> None:
        with self._lock:
            self.cached = self.prompt = self.items = 0


class _Replay:
    """A response body already read, served again through ``read1`` (what the client calls)."""

    connection = None  # the client sets a socket timeout only when there is one

    def __init__(self, data: bytes, raw) -> None:
        self._buf, self._raw = io.BytesIO(data), raw

    def read1(self, amt: int = -1, decode_content: bool = True) -> bytes:
        return self._buf.read1(amt)

    def close(self) -> None:
        self._raw.close()

    def release_conn(self) -> None:
        self._raw.release_conn()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PrefillClock:
    """Wall seconds of the trainside model's prefill forwards (the first forward of each
    ``generate`` call: more than one position), by forward hooks on the backend's model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds, self.forwards, self._start = 0.0, 0, None
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(self._post, with_kwargs=True)

    def _pre(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._start = None
        if ids is not None and ids.shape[-1] > 1:
            _sync(ids.device)
            self._start = time.perf_counter()

    def _post(self, module, args, kwargs, output) -> None:
        if self._start is not None:
            _sync(output.logits.device)
            self.seconds += time.perf_counter() - self._start
            self.forwards += 1
            self._start = None

    def reset(self) -> None:
        self.seconds, self.forwards = 0.0, 0


@dataclasses.dataclass
class Engine:
    """One backend under test and how to reset its prefix cache before a measured batch."""

    name: str
    backend: Any
    flush: Any = None  # () -> None, SGLang: POST /flush_cache
    cached: CachedTokens | None = None
    prefill: PrefillClock | None = None
    keeps_cache: bool = False  # trainside: each episode keeps its KV cache between turns


def flush_fn(backend, url: str):
    def flush() -> None:
        response = backend.session.post(url + "/flush_cache", timeout=60)
        if not response.ok:
            raise RuntimeError(
                f"SGLang POST {url}/flush_cache answered HTTP {response.status_code}: "
                f"{response.text[:300]!r}; it refuses while requests are running"
            )

    return flush


# ----------------------------------------------------------------------------- one batch
def episode_batch(engine: Engine, prompts, k: int, args, seed: int, deltas, eos: int) -> dict:
    """One batch of ``len(prompts)`` episodes of ``k`` turns (``T // k`` new tokens each)."""
    per_turn = args.total_tokens // k
    if engine.name == "one_loop":
        return one_loop_batch(engine, prompts, k, args, seed, deltas[False])
    contexts = [list(p) for p in prompts]
    if engine.flush is not None:
        engine.flush()
    if engine.cached is not None:
        engine.cached.reset()
    if engine.prefill is not None:
        engine.prefill.reset()
    submitted, generated, turn_s, finishes = 0, [0] * len(prompts), [], []
    episodes = EpisodeCache() if engine.keeps_cache and k > 1 else None  # K = 1: one generation
    kept = {} if episodes is None else {"episodes": episodes, "episode_ids": range(len(prompts))}
    start, cpu_start = time.perf_counter(), time.process_time()
    for turn in range(k):
        sampling = SamplingParams(
            max_new_tokens=per_turn, temperature=1.0, top_p=1.0, top_k=-1, seed=seed + turn
        )
        submitted += sum(map(len, contexts))
        t0 = time.perf_counter()
        out = engine.backend.generate(contexts, 1, sampling, **kept)
        turn_s.append(time.perf_counter() - t0)
        for b, c in enumerate(out):
            contexts[b] += c.token_ids
            generated[b] += len(c)
            finishes.append(c.finish_reason)
            if not args.allow_eos and len(c) != per_turn:
                raise RuntimeError(
                    f"{engine.name}: turn {turn} of episode {b} generated {len(c)} tokens "
                    f"(finish_reason {c.finish_reason!r}) with EOS switched off; expected exactly "
                    f"max_new_tokens={per_turn}"
                )
            if turn < k - 1:
                closed = bool(c.token_ids) and c.token_ids[-1] == eos
                contexts[b] += deltas[closed]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    cached = engine.cached.cached if engine.cached is not None else None
    if episodes is not None:  # the trainside engine's own cache
        cached = episodes.reused_tokens
    if engine.cached is not None and engine.cached.prompt != submitted:
        raise RuntimeError(
            f"{engine.name}: SGLang reported {engine.cached.prompt} prompt tokens over "
            f"{engine.cached.items} answers, the episodes submitted {submitted}"
        )
    return dict(
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        turn_seconds=turn_s,
        generated_tokens=sum(generated),
        min_episode_tokens=min(generated),
        max_episode_tokens=max(generated),
        submitted_prompt_tokens=submitted,
        cached_tokens=cached,
        prefilled_tokens=submitted - (cached or 0),
        prefill_seconds=None if engine.prefill is None else engine.prefill.seconds,
        prefill_forwards=None if engine.prefill is None else engine.prefill.forwards,
        final_context_tokens=sum(map(len, contexts)),
        finish_reasons={r: finishes.count(r) for r in sorted(set(finishes))},
        seed=seed,
    )


@torch.no_grad()
def one_loop_episodes(
    model: torch.nn.Module, prompts: list[list[int]], k: int, per_turn: int, seed: int, delta
) -> tuple[list[list[int]], list[list[float]]]:
    """The forwards of ``k`` turns of ``per_turn`` tokens in one decode loop (the ``one_loop`` bound).

    Every episode starts from its prompt (all of one length: no padding), samples ``per_turn``
    tokens per turn like ``TransformersBackend`` (``sample_next_token``, temperature 1, a
    generator seeded ``seed + turn`` at each turn, EOS never stops) and, between turns, forwards
    its last sampled token followed by ``delta`` (the tool answer) in one forward, as the trainside
    engine's next turn does from its kept cache; but all of it into one preallocated cache of the
    whole episode, in one loop.

    Returns:
        per episode the final context (prompt, turns, deltas) and the log-prob of every sampled token.
    """
    from ar_torchrl.backends.transformers.kv_cache import decode_cache
    from ar_torchrl.backends.transformers.token_sampling import sample_next_token

    if len({len(p) for p in prompts}) != 1:
        raise ValueError(
            f"one_loop_episodes: the prompts must all have one length (no padding), got lengths "
            f"{sorted({len(p) for p in prompts})}"
        )
    device = next(model.parameters()).device
    bsz, width = len(prompts), len(prompts[0])
    capacity = width + k * per_turn + (k - 1) * len(delta)
    cache = decode_cache(model.config, capacity)
    delta_t = torch.tensor(delta, dtype=torch.long, device=device).expand(bsz, -1)
    step = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones((bsz, capacity), dtype=torch.long, device=device)
    tokens, log_probs, filled = [], [], 0
    for turn in range(k):
        sampling = SamplingParams(max_new_tokens=per_turn, temperature=1.0, seed=seed + turn)
        generator = torch.Generator(device=device).manual_seed(seed + turn)
        for t in range(per_turn):
            q = step.shape[1]
            positions = torch.arange(filled, filled + q, device=device).expand(bsz, q)
            filled += q
            out = model(
                input_ids=step,
                attention_mask=mask[:, :filled],  # one allocation, sliced, as the engine does
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            tok, lp = sample_next_token(out.logits[:, -1], sampling, generator, "temperature")
            tokens.append(tok)
            log_probs.append(lp)
            step = tok[:, None]
            if t == per_turn - 1 and turn < k - 1:  # the turn's last token, then the tool delta
                step = torch.cat([step, delta_t], dim=1)
    sampled, lps = torch.stack(tokens, 1).tolist(), torch.stack(log_probs, 1).tolist()
    contexts = []
    for b in range(bsz):
        context = list(prompts[b])
        for turn in range(k):
            context += sampled[b][turn * per_turn : (turn + 1) * per_turn]
            if turn < k - 1:
                context += list(delta)
        contexts.append(context)
    return contexts, lps


def one_loop_batch(engine: Engine, prompts, k: int, args, seed: int, delta) -> dict:
    """:func:`one_loop_episodes` timed, with the keys of :func:`episode_batch` (``submitted``:
    the context tokens forwarded, the prompt and the ``k - 1`` deltas; nothing is cached)."""
    per_turn = args.total_tokens // k
    start, cpu_start = time.perf_counter(), time.process_time()
    contexts, _ = one_loop_episodes(engine.backend, prompts, k, per_turn, seed, delta)  # synced
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    submitted = sum(len(p) + (k - 1) * len(delta) for p in prompts)
    generated = [len(c) - len(p) - (k - 1) * len(delta) for c, p in zip(contexts, prompts)]
    return dict(
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        turn_seconds=[seconds],
        generated_tokens=sum(generated),
        min_episode_tokens=min(generated),
        max_episode_tokens=max(generated),
        submitted_prompt_tokens=submitted,
        cached_tokens=None,
        prefilled_tokens=submitted,
        prefill_seconds=None,
        prefill_forwards=None,
        final_context_tokens=sum(map(len, contexts)),
        finish_reasons={"length": len(prompts) * k},
        seed=seed,
    )


# ----------------------------------------------------------------------------- the run
@contextlib.contextmanager
def engines(args, model, tok):
    """The backends under test (a launched server is stopped on exit, also on an error)."""
    with contextlib.ExitStack() as stack:
        out = []
        for name in args.backends:
            if name == "one_loop":  # the trainside engine's private copy of the model, unwrapped
                out.append(Engine(name, TransformersBackend(model, mode="copy").model))
                continue
            if name.startswith("trainside"):
                backend = TransformersBackend(
                    model, mode="copy", eos_token_id=(() if not args.allow_eos else None)
                )
                keeps = name == "trainside"  # trainside_prefill: the whole context every turn
                clock = PrefillClock(backend.model)
                out.append(Engine(name, backend, prefill=clock, keeps_cache=keeps))
                continue
            from ar_torchrl.backends import SGLangBackend, SGLangClientOptions, launch_sglang_server
            from ar_torchrl.weight_sync import named_policy_tensors

            url = args.url
            if url is None:  # --launch
                tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-mt-")))
                model_dir = save_tiny_model(
                    tmp / "model", seed=args.seed, hidden_size=args.hidden, num_layers=args.layers
                )
                server = stack.enter_context(
                    launch_sglang_server(
                        model_dir,
                        log_file=tmp / "server.log",
                        timeout_s=600,
                        extra_args=LAUNCH_ARGS,
                    )
                )
                url = server.url
            extra = {} if args.allow_eos else {"ignore_eos": True}
            backend = stack.enter_context(
                SGLangBackend(
                    url,
                    options=SGLangClientOptions(
                        max_concurrency=args.batch,
                        timeout_s=900,
                        extra_sampling_params=extra,
                        vocab_size=len(tok),
                        show_progress=False,
                    ),
                )
            )
            # the same weights as the trainside model (a --url server may serve others)
            backend.sync_weights(named_policy_tensors(model), version=1)
            out.append(Engine("sglang", backend, flush_fn(backend, url), CachedTokens(backend)))
        yield out


def summarize(
    name: str,
    k: int,
    args,
    reps: list[dict],
    ones: list[dict],
    same: list[dict] | None,
    bound: list[dict] | None = None,
) -> dict:
    """Medians over the repetitions; ``ratio``: median of the per-repetition ``t_K / t_1``;
    ``same_context_ratio``: of ``t_K / t`` of one generation whose prompt already holds the
    ``K - 1`` tool answers (the episode's final context length: what the turns cost beyond the
    longer context the tool answers add); ``over_one_loop``: of ``t_K / t`` of the ``one_loop``
    bound at the same ``K`` (what the turns cost beyond their forwards), [min, median, max]."""

    def spread(others: list[dict] | None) -> list[float] | None:
        ratios = sorted(r["seconds"] / o["seconds"] for r, o in zip(reps, others or []))
        return [ratios[0], statistics.median(ratios), ratios[-1]] if ratios else None

    same_context = spread(same)
    med = {
        key: statistics.median(r[key] for r in reps)
        for key in ("seconds", "generated_tokens", "submitted_prompt_tokens", "prefilled_tokens")
    }
    cached = [r["cached_tokens"] for r in reps if r["cached_tokens"] is not None]
    ratios = [r["seconds"] / o["seconds"] for r, o in zip(reps, ones)]
    cpu_ratios = sorted(r["cpu_seconds"] / o["cpu_seconds"] for r, o in zip(reps, ones))
    prefill = [r["prefill_seconds"] for r in reps if r["prefill_seconds"] is not None]
    return dict(
        backend=name,
        turns=k,
        max_new_tokens_per_turn=args.total_tokens // k,
        episodes=args.batch,
        seconds=med["seconds"],
        ms_per_episode=1e3 * med["seconds"] / args.batch,
        generated_tokens=med["generated_tokens"],
        generated_tokens_per_episode=med["generated_tokens"] / args.batch,
        ms_per_generated_token=1e3
        * statistics.median(r["seconds"] / r["generated_tokens"] for r in reps),
        ratio=statistics.median(ratios),
        cpu_ratio=statistics.median(cpu_ratios),
        cpu_ratio_range=[cpu_ratios[0], cpu_ratios[-1]],
        ratio_reps=ratios,
        ratio_of_medians=med["seconds"] / statistics.median(o["seconds"] for o in ones),
        same_context_ratio=same_context,
        over_one_loop=spread(bound) if name != "one_loop" else None,
        same_context_seconds=statistics.median(o["seconds"] for o in same) if same else None,
        submitted_prompt_tokens=med["submitted_prompt_tokens"],
        cached_tokens=statistics.median(cached) if cached else None,
        prefilled_tokens=med["prefilled_tokens"],
        prefill_seconds=statistics.median(prefill) if prefill else None,
        reps=reps,
    )


def run(args) -> tuple[dict, dict]:
    torch.set_num_threads(args.threads)
    tok = build_char_tokenizer()
    eos = tok.eos_token_id
    model = build_tiny_qwen3(
        len(tok),
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        max_position_embeddings=MAX_POSITIONS,
        seed=args.seed,
    ).to(device=args.device, dtype=getattr(torch, args.dtype))
    prompts = make_prompts(tok, args.batch, args.seed, args.system_chars)
    deltas = {  # after a turn cut at its cap / after a turn that sampled EOS (with --allow-eos)
        False: tool_delta_ids(tok, [TOOL_ANSWER], include_end_of_turn=True),
        True: tool_delta_ids(tok, [TOOL_ANSWER]),
    }
    final = len(prompts[0]) + args.total_tokens + (max(args.ks) - 1) * len(deltas[False])
    if final > MAX_POSITIONS:
        raise SystemExit(
            f"an episode's final context is {final} tokens (prompt {len(prompts[0])}, "
            f"--total-tokens {args.total_tokens}, {max(args.ks) - 1} tool deltas of "
            f"{len(deltas[False])}), over the model's {MAX_POSITIONS} positions: lower "
            "--system-chars, --total-tokens or the largest K"
        )
    info = dict(prompt_tokens=len(prompts[0]), tool_delta_tokens=len(deltas[False]))
    runs: dict[tuple[str, int], list[dict]] = {}
    with engines(args, model, tok) as engs:
        for e in engs:
            if e.name == "sglang":
                infos = e.backend.server_info()
                info["sglang_version"] = infos[0].get("version")
                info["sglang_url"] = e.backend.urls[0]
            for k in args.ks:  # warm-up: first-call costs
                episode_batch(
                    e, prompts, k, args, args.seed + 10_000 * (args.reps + 1), deltas, eos
                )
        for rep in range(args.reps):  # round-robin; the order of the K rotates
            order = args.ks[rep % len(args.ks) :] + args.ks[: rep % len(args.ks)]
            for e in engs:
                for k in order:
                    seed = args.seed + 10_000 * (rep + 1)  # the same seeds on both backends
                    r = episode_batch(e, prompts, k, args, seed, deltas, eos)
                    runs.setdefault((e.name, k), []).append(r)
                    if k > 1 and e.name != "one_loop":  # one generation of the final context
                        longer = [p + deltas[False] * (k - 1) for p in prompts]
                        r = episode_batch(e, longer, 1, args, seed, deltas, eos)
                        runs.setdefault((e.name, -k), []).append(r)
    rows = [
        summarize(
            name,
            k,
            args,
            runs[name, k],
            runs[name, 1],
            runs.get((name, -k)),
            runs.get(("one_loop", k)),
        )
        for name in args.backends
        for k in args.ks
    ]
    ratios = {
        name: {str(r["turns"]): r["ratio"] for r in rows if r["backend"] == name}
        for name in args.backends
    }
    return dict(rows=rows, ratios=ratios), info


# ----------------------------------------------------------------------------- reporting
def report(result: dict, args) -> str:
    head = (
        f"  {'backend':<17} {'K':>2} {'tok/turn':>8} {'s/batch':>8} {'ms/tok':>7} "
        f"{'ratio [min, max]':>20} {'CPU ratio [min, max]':>21} {'submitted':>9} {'cached':>7} "
        f"{'prefilled':>9} {'prefill s':>9} {'x same context [min, max]':>26} "
        f"{'x one loop [min, max]':>22}"
    )
    lines = [
        f"{args.batch} episodes x {args.total_tokens} generated tokens, K turns of "
        f"{args.total_tokens}/K tokens (median of {args.reps} reps, round-robin; ratio = "
        "time(K turns) / time(1 generation), median [min, max] of per-rep ratios; CPU ratio: the "
        "same with this process's CPU time, load-insensitive at 1 thread, the server's not counted)",
        head,
    ]
    for r in result["rows"]:
        cached = "-" if r["cached_tokens"] is None else f"{r['cached_tokens']:.0f}"
        ratio = f"{r['ratio']:.2f} [{min(r['ratio_reps']):.2f}, {max(r['ratio_reps']):.2f}]"
        lo, hi = r["cpu_ratio_range"]
        cpu = f"{r['cpu_ratio']:.2f} [{lo:.2f}, {hi:.2f}]"
        if r["backend"] == "sglang":  # this process's CPU: the client, not the server's compute
            cpu = "-"
        prefill = "-" if r["prefill_seconds"] is None else f"{r['prefill_seconds']:.3f}"
        same, bound = (_spread_text(r[key]) for key in ("same_context_ratio", "over_one_loop"))
        lines.append(
            f"  {r['backend']:<17} {r['turns']:>2} {r['max_new_tokens_per_turn']:>8} "
            f"{r['seconds']:>8.3f} {r['ms_per_generated_token']:>7.3f} {ratio:>20} {cpu:>21} "
            f"{r['submitted_prompt_tokens']:>9.0f} {cached:>7} {r['prefilled_tokens']:>9.0f} "
            f"{prefill:>9} {same:>26} {bound:>22}"
        )
    lines.append(
        "  (submitted: prompt tokens sent over all turns; cached: taken from the kept KV cache "
        "(trainside) or SGLang's meta_info.cached_tokens; prefilled = submitted - cached; "
        "prefill s: the trainside model's prefill forwards, hooks; x same context: time(K turns) / "
        "time(1 generation whose prompt already holds the K - 1 tool answers), per rep: the cost "
        "of the turns beyond the longer context the tool answers add; one_loop: the same forwards in one "
        "decode loop over one cache, no call per turn (a bound); x one loop: time(K turns) / "
        "time(one_loop, same K), per rep: what the turns cost beyond their forwards)"
    )
    return "\n".join(lines) + "\n"


def _spread_text(spread: list[float] | None) -> str:
    """``[min, median, max]`` as ``"median [min, max]"`` (``None``: ``"-"``)."""
    if spread is None:
        return "-"
    lo, med, hi = spread
    return f"{med:.2f} [{lo:.2f}, {hi:.2f}]"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backends",
        default="trainside,trainside_prefill,one_loop,sglang",
        help="comma list of " + ",".join(BACKENDS),
    )
    p.add_argument("--url", default=None, help="a running SGLang server (its weights are replaced)")
    p.add_argument("--launch", action="store_true", help="launch a local SGLang server")
    p.add_argument("--ks", default=None, help="turn counts, comma list (default 1,2,4,8)")
    p.add_argument("--total-tokens", type=int, default=None, help="T per episode (96; quick 48)")
    p.add_argument("--batch", type=int, default=None, help="episodes per batch (16; quick 4)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 15; quick 2)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the trainside model's")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--system-chars",
        type=int,
        default=0,
        help="lead every prompt with a system message of this many characters (0: none)",
    )
    p.add_argument("--allow-eos", action="store_true", help="EOS ends a turn (lengths then vary)")
    p.add_argument("--quick", action="store_true", help="T=48, B=4, 2 reps")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in args.backends if b not in BACKENDS]
    if unknown or not args.backends or len(set(args.backends)) != len(args.backends):
        p.error(f"--backends must be distinct names of {BACKENDS}, got {args.backends}")
    if args.url and args.launch:
        p.error("--url and --launch exclude each other: use a running server or launch one")
    if "sglang" in args.backends and not (args.url or args.launch):
        p.error("--backends has sglang: pass --url URL of a running server, or --launch")
    if "sglang" in args.backends and (args.heads != 4 or args.device != "cpu"):
        p.error("--heads / --device cuda apply to the trainside engines only (the server's model)")
    if "one_loop" in args.backends and args.allow_eos:
        p.error("one_loop runs every turn to its cap: it does not take --allow-eos")
    if "sglang" not in args.backends and (args.url or args.launch):
        p.error(f"--url/--launch given but --backends is {args.backends} (no sglang)")
    args.ks = [int(k) for k in (args.ks or "1,2,4,8").split(",")]
    args.total_tokens = args.total_tokens or (48 if args.quick else 96)
    args.batch = args.batch or (4 if args.quick else 16)
    args.reps = args.reps or (2 if args.quick else 15)
    if 1 not in args.ks or min(args.ks) < 1 or len(set(args.ks)) != len(args.ks):
        p.error(
            f"--ks must be distinct turn counts >= 1 including 1 (the reference), got {args.ks}"
        )
    bad = [k for k in args.ks if args.total_tokens % k]
    if bad:
        p.error(
            f"--total-tokens {args.total_tokens} is not divisible by K={bad}: every turn gets "
            "T // K tokens; pick a T that all K divide"
        )
    if args.system_chars < 0:
        p.error(f"--system-chars must be >= 0 (0: no system message), got {args.system_chars}")
    if args.reps < 1 or args.batch < 1:
        p.error(f"--reps and --batch must be >= 1, got {args.reps} and {args.batch}")
    args.out = args.out or RESULTS / f"bench_multi_turn{'_quick' if args.quick else ''}.json"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    result, info = run(args)
    meta = dict(
        backends=args.backends,
        ks=args.ks,
        total_tokens=args.total_tokens,
        episodes=args.batch,
        reps=args.reps,
        threads=args.threads,
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        seed=args.seed,
        system_chars=args.system_chars,
        quick=args.quick,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        device=args.device,
        dtype=args.dtype,
        eos_stops=args.allow_eos,
        launched=args.launch,
        url=args.url,
        temperature=1.0,
        tool_answer=TOOL_ANSWER,
        **info,
        load_average=[load_before, os.getloadavg()[0]],
        **code_version(),
        **machine_info(),
    )
    sys.stdout.write(report(result, args))
    sys.stdout.write(
        f"load average {meta['load_average'][0]:.1f} -> {meta['load_average'][1]:.1f}; "
        f"commit {meta['commit']}{' (dirty)' if meta['dirty'] else ''}\n"
    )
    write_json({"config": meta, "results": result}, args.out)
    sys.stdout.write(f"wrote {args.out}\n")


if __name__ == "__main__":
    main()
