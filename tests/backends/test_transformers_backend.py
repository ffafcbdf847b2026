"""TransformersBackend: log-probs vs a plain full forward, EOS/stop handling, padding, top-k/top-p, seeds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ar_torchrl.backends import (
    EpisodeCache,
    SamplingParams,
    TransformersBackend,
    next_token_log_probs,
)
from ar_torchrl.backends.transformers.kv_cache import PreallocatedLayer
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import attach_value_head
from ar_torchrl.weight_sync import WeightSyncError, named_policy_tensors

torch.set_num_threads(1)

VOCAB = 99
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]  # ragged


@pytest.fixture(scope="module")
def model():
    return build_tiny_qwen3(VOCAB, seed=0)


def reference_log_probs(model, prompt, completion, sampling) -> torch.Tensor:
    """Plain full forward of prompt + completion (no padding, no cache), fp32 log-softmax at T."""
    seq = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    steps = logits[len(prompt) - 1 : -1]  # logits at t-1 predict token t
    return next_token_log_probs(steps, sampling).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def hand_filtered_probs(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> list[float]:
    """Obviously-correct twin of next_token_log_probs for one row (Python floats, loops)."""
    scaled = [x / temperature for x in logits]
    keep = set(range(len(scaled)))
    if top_k != -1:
        kth = sorted(scaled, reverse=True)[top_k - 1]
        keep = {i for i in keep if scaled[i] >= kth}
    if top_p < 1.0:
        z = sum(math.exp(scaled[i]) for i in keep)
        mass, kept = 0.0, set()
        for i in sorted(keep, key=lambda i: -scaled[i]):
            if mass < top_p:
                kept.add(i)
            mass += math.exp(scaled[i]) / z
        keep = kept
    z = sum(math.exp(scaled[i]) for i in keep)
    return [math.exp(scaled[i]) / z if i in keep else 0.0 for i in range(len(scaled))]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_log_probs_match_full_forward_including_first_token(model, temperature):
    sampling = SamplingParams(max_new_tokens=12, temperature=temperature, seed=3)
    out = TransformersBackend(model).generate(PROMPTS, n=2, sampling=sampling)
    assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2]
    for c in out:
        ref = reference_log_probs(model, PROMPTS[c.prompt_index], c.token_ids, sampling)
        torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-5, rtol=0)
        assert c.log_probs[0] < 0  # the first generated token has a real log-prob, not 0


def test_greedy_matches_hf_generate(model):
    sampling = SamplingParams(max_new_tokens=10, temperature=0.0)
    out = TransformersBackend(model).generate(PROMPTS, n=1, sampling=sampling)
    for c in out:
        prompt = torch.tensor([PROMPTS[c.prompt_index]])
        ref = model.generate(
            prompt, max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=0
        )
        assert c.token_ids == ref[0, prompt.shape[1] :].tolist()


def test_stop_tokens_are_kept_and_end_the_completion(model):
    stops = tuple(range(20, 60))  # frequent enough that most completions stop early
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=stops, seed=0)
    out = TransformersBackend(model).generate(PROMPTS, n=4, sampling=sampling)
    reasons = {c.finish_reason for c in out}
    assert reasons == {"stop", "length"} or reasons == {"stop"}
    for c in out:
        hits = [i for i, t in enumerate(c.token_ids) if t in stops or t == 2]
        if c.finish_reason == "stop":
            assert hits == [len(c) - 1]  # the stop token is kept, and it is the last one
        else:
            assert hits == [] and len(c) == 16
        ref = reference_log_probs(model, PROMPTS[c.prompt_index], c.token_ids, sampling)
        torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-5, rtol=0)


def test_finished_rows_are_dropped_and_results_do_not_change(model, monkeypatch):
    # Greedy rows of this model repeat one token; these stop ids end two of the eight rows at
    # once and one at step 7, so the loop drops finished rows from the batch (the cache's
    # batch_select_indices runs). Every row must still decode as it does alone, and as
    # `model.generate` decodes it.
    stops = (49, 18, 3)
    calls = []
    original = PreallocatedLayer.batch_select_indices
    monkeypatch.setattr(
        PreallocatedLayer,
        "batch_select_indices",
        lambda self, idx: calls.append(len(idx)) or original(self, idx),
    )
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=stops)
    prompts = PROMPTS + [[p + 1 for p in row] for row in PROMPTS] + [[3, 4, 5], [60, 61]]
    batched = TransformersBackend(model).generate(prompts, 1, greedy)
    assert calls, "no row was dropped: the test does not exercise the shrinking batch"
    assert len({len(c) for c in batched}) > 1
    for c in batched:
        alone = TransformersBackend(model).generate([prompts[c.prompt_index]], 1, greedy)[0]
        assert c.token_ids == alone.token_ids
        torch.testing.assert_close(
            torch.tensor(c.log_probs), torch.tensor(alone.log_probs), atol=1e-5, rtol=0
        )
        ref = model.generate(
            torch.tensor([prompts[c.prompt_index]]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=[2, *stops],
            pad_token_id=0,
        )
        assert c.token_ids == ref[0, len(prompts[c.prompt_index]) :].tolist()


def test_preallocated_cache_layer_equals_the_dynamic_layer():
    from transformers.cache_utils import DynamicLayer

    ours, ref = PreallocatedLayer(capacity=6), DynamicLayer()
    steps = [torch.randn(3, 2, 4, 5), torch.randn(3, 2, 1, 5), torch.randn(3, 2, 1, 5)]
    for k in steps:
        got, want = ours.update(k, -k), ref.update(k, -k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert ours.get_seq_length() == ref.get_seq_length()
        assert ours.get_mask_sizes(1) == ref.get_mask_sizes(1)
    keep = torch.tensor([2, 0])
    ours.batch_select_indices(keep)
    ref.batch_select_indices(keep)
    assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
    with pytest.raises(RuntimeError, match="7 positions exceed the capacity of 6"):
        ours.update(torch.randn(2, 2, 1, 5), torch.randn(2, 2, 1, 5))


def test_kept_states_and_load_kept_against_a_plain_loop():
    from ar_torchrl.backends.transformers.kv_cache import (
        KeptState,
        decode_cache,
        kept_states,
        load_kept,
    )

    config = build_tiny_qwen3(VOCAB, num_layers=2).config
    gen = torch.Generator().manual_seed(0)
    cache = decode_cache(config, capacity=9)
    for layer in cache.layers:  # 4 rows, 7 filled positions, 4 kv heads, head dim 16
        layer.update(
            torch.randn(4, 4, 7, 16, generator=gen), torch.randn(4, 4, 7, 16, generator=gen)
        )
    mask = torch.tensor(  # real positions: a kept prefix, left padding, new tokens, a finished row
        [[0, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 0], [0, 1, 0, 1, 1, 0, 0]]
    )
    rows = [3, 0, 2]
    got = kept_states(cache, rows, mask)
    for out, r in zip(got, rows):  # the plain loop: the real columns of row r, in order
        real = [j for j in range(7) if mask[r, j]]
        for (k, v), layer in zip(out, cache.layers):
            assert torch.equal(k, layer.keys[r][:, real]) and torch.equal(
                v, layer.values[r][:, real]
            )
    # a row whose real columns are one run (row 2) is a view of the cache, rows with holes copies
    storage = cache.layers[0].keys.untyped_storage().data_ptr()
    assert got[2][0][0].data_ptr() == cache.layers[0].keys[2, :, 4:6].data_ptr()
    assert [out[0][0].untyped_storage().data_ptr() == storage for out in got] == [
        False,
        False,
        True,
    ]
    # load them (and an empty row) into a fresh cache, using a prefix of each: right-aligned, zeros before
    states = [KeptState(list(range(k[0][0].shape[1])), k) for k in got] + [None]
    used = [3, 5, 1, 0]
    fresh = decode_cache(config, capacity=8)
    prefix_mask = load_kept(fresh, states, used)
    assert prefix_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [0] * 5]
    for layer_index, layer in enumerate(fresh.layers):
        assert layer.get_seq_length() == 5
        for i, (state, n) in enumerate(zip(states, used)):
            for part, buf in enumerate((layer.keys, layer.values)):
                want = torch.zeros(4, 5, 16)
                if n:
                    want[:, 5 - n :] = state.layers[layer_index][part][:, :n]
                assert torch.equal(buf[i], want)
    with pytest.raises(RuntimeError, match="already holds positions"):
        fresh.layers[0].load_prefix(states[:1], [1], 1)


def test_eos_override_and_pad_equal_eos(model):
    # A tokenizer with pad == eos: the EOS token (which equals the pad id) stays in the completion.
    eos = 44
    sampling = SamplingParams(max_new_tokens=30, temperature=1.5, seed=1)
    backend = TransformersBackend(model, eos_token_id=eos, pad_token_id=eos)
    out = backend.generate(PROMPTS, n=4, sampling=sampling)
    stopped = [c for c in out if c.finish_reason == "stop"]
    assert stopped, "expected some completions to hit EOS"
    assert all(c.token_ids[-1] == eos and eos not in c.token_ids[:-1] for c in stopped)


def test_results_do_not_depend_on_the_pad_id(model):
    # The pad id is only ever written under a False attention mask; sampled tokens equal to it
    # (here: every id in turn is a candidate) are tracked by length, never dropped.
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    base = TransformersBackend(model, pad_token_id=0).generate(PROMPTS, 3, sampling)
    sampled = {t for c in base for t in c.token_ids}
    pad = next(iter(sorted(sampled - {2})))
    other = TransformersBackend(model, pad_token_id=pad).generate(PROMPTS, 3, sampling)
    assert [c.token_ids for c in other] == [c.token_ids for c in base]
    assert any(pad in c.token_ids for c in other)
    for a, b in zip(base, other):
        torch.testing.assert_close(
            torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-6, rtol=0
        )


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (-1, 0.6), (7, 0.8), (1, 1.0)])
def test_top_k_top_p_against_hand_loop(top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 20, generator=gen) * 2
    sampling = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    probs = next_token_log_probs(logits, sampling).exp()
    for row in range(4):
        hand = hand_filtered_probs(logits[row].tolist(), 0.8, top_k, top_p)
        torch.testing.assert_close(probs[row], torch.tensor(hand), atol=1e-6, rtol=0)


def test_default_log_probs_are_unfiltered_temperature_scaled_under_top_k_top_p(model):
    # The project's convention (and SGLang's): log softmax(logits / T) of the unfiltered
    # distribution, also when top-k/top-p filter what is sampled.
    sampling = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=3, top_p=0.9, seed=2)
    out = TransformersBackend(model).generate(PROMPTS, n=3, sampling=sampling)
    unfiltered = SamplingParams(temperature=0.9)
    for c in out:
        filtered = reference_log_probs(model, PROMPTS[c.prompt_index], c.token_ids, sampling)
        assert torch.isfinite(filtered).all()  # every sampled token is inside the filtered support
        ref = reference_log_probs(model, PROMPTS[c.prompt_index], c.token_ids, unfiltered)
        torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-5, rtol=0)


def test_processed_logprob_mode_reports_the_filtered_distribution(model):
    sampling = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=4, seed=2)
    default = TransformersBackend(model).generate(PROMPTS, 2, sampling)
    processed = TransformersBackend(model, logprob_mode="processed").generate(PROMPTS, 2, sampling)
    for a, b in zip(default, processed):
        assert a.token_ids == b.token_ids  # same draws, only the reported log-prob differs
        ref = reference_log_probs(model, PROMPTS[b.prompt_index], b.token_ids, sampling)
        torch.testing.assert_close(torch.tensor(b.log_probs), ref, atol=1e-5, rtol=0)
        assert all(x >= y - 1e-6 for x, y in zip(b.log_probs, a.log_probs))  # renormalised >= raw
        assert b.log_probs != a.log_probs
    with pytest.raises(ValueError, match="logprob_mode must be 'temperature' or 'processed'"):
        TransformersBackend(model, logprob_mode="filtered")


def test_seeding(model):
    seeded = SamplingParams(max_new_tokens=10, seed=7)
    a = TransformersBackend(model).generate(PROMPTS, 2, seeded)
    b = TransformersBackend(model, seed=123).generate(PROMPTS, 2, seeded)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]  # per-call seed wins
    unseeded = SamplingParams(max_new_tokens=10)
    x, y = TransformersBackend(model, seed=1), TransformersBackend(model, seed=1)
    first, second = x.generate(PROMPTS, 2, unseeded), x.generate(PROMPTS, 2, unseeded)
    assert [c.token_ids for c in first] != [c.token_ids for c in second]  # the stream advances
    assert [c.token_ids for c in y.generate(PROMPTS, 2, unseeded)] == [c.token_ids for c in first]
    state = x.state_dict()
    third = x.generate(PROMPTS, 2, unseeded)
    y.load_state_dict(state)
    assert [c.token_ids for c in y.generate(PROMPTS, 2, unseeded)] == [c.token_ids for c in third]


def test_max_batch_size_chunks_give_the_same_greedy_output(model):
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    whole = TransformersBackend(model).generate(PROMPTS, 2, sampling)
    chunked = TransformersBackend(model, max_batch_size=4).generate(PROMPTS, 2, sampling)
    assert [c.token_ids for c in whole] == [c.token_ids for c in chunked]


def lp(completions) -> list[list[float]]:
    return [c.log_probs for c in completions]


def test_copy_mode_sync_loads_new_weights_and_drops_value_head():
    trainer = attach_value_head(build_tiny_qwen3(VOCAB, seed=1))
    backend = TransformersBackend(build_tiny_qwen3(VOCAB, seed=0), mode="copy")
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    copy_backend = TransformersBackend(trainer)
    assert hasattr(trainer, "value_head") and not hasattr(copy_backend.model, "value_head")
    assert copy_backend.model is not trainer and not any(
        p.requires_grad for p in copy_backend.model.parameters()
    )
    expected = copy_backend.generate(PROMPTS, 1, greedy)
    before = backend.generate(PROMPTS, 1, greedy)
    assert lp(before) != lp(expected)
    backend.sync_weights(trainer.state_dict().items(), version=3)  # raw state_dict: head dropped
    after = backend.generate(PROMPTS, 1, greedy)
    assert [c.token_ids for c in after] == [c.token_ids for c in expected]
    assert lp(after) == lp(expected)
    assert backend.policy_version == 3 and after[0].policy_version == 3


def test_rejected_syncs_keep_the_version():
    backend = TransformersBackend(build_tiny_qwen3(VOCAB, seed=0), mode="copy")
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = lp(backend.generate(PROMPTS, 1, greedy))
    other = list(named_policy_tensors(build_tiny_qwen3(VOCAB, seed=2)))
    first = other[0][0]
    # refused at the first tensor: nothing copied, generation goes on with the old weights
    with pytest.raises(WeightSyncError, match=rf"shape of '{first}' is \(3,\)") as info:
        backend.sync_weights([(first, torch.zeros(3)), *other[1:]], 4)
    assert not info.value.partial and backend.policy_version == 0
    assert lp(backend.generate(PROMPTS, 1, greedy)) == before
    # refused after some tensors were copied: partial, generation refused until a good sync
    with pytest.raises(WeightSyncError, match=r"missing \['lm_head.weight'\]") as info:
        backend.sync_weights([(n, t) for n, t in other if n != "lm_head.weight"], 4)
    assert info.value.partial and backend.policy_version == 0
    with pytest.raises(WeightSyncError, match="failed part-way"):
        backend.generate(PROMPTS, 1, greedy)
    backend.sync_weights(other, 5)
    assert backend.policy_version == 5 and lp(backend.generate(PROMPTS, 1, greedy)) != before


def test_copy_mode_consumes_the_tensors_one_at_a_time():
    trainer = build_tiny_qwen3(VOCAB, seed=1)
    backend = TransformersBackend(build_tiny_qwen3(VOCAB, seed=0), mode="copy")
    rollout = backend.model.state_dict()
    copied_before_next = []

    def stream():
        previous = None
        for name, tensor in named_policy_tensors(trainer):
            if previous is not None:  # the previous tensor is already in the rollout model
                copied_before_next.append(
                    torch.equal(rollout[previous], trainer.state_dict()[previous])
                )
            previous = name
            yield name, tensor

    backend.sync_weights(stream(), version=1)
    assert copied_before_next and all(copied_before_next)


def test_share_mode_samples_from_the_trainer_module(model):
    backend = TransformersBackend(model, mode="share")
    assert backend.model is model
    backend.sync_weights(named_policy_tensors(model), version=1)
    assert backend.policy_version == 1


def test_bad_arguments(model):
    backend = TransformersBackend(model)
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        backend.generate([[1, 2], []], 1, SamplingParams())
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        backend.generate([[1, 2]], 0, SamplingParams())
    with pytest.raises(ValueError, match="mode must be 'copy' or 'share', got 'ref'"):
        TransformersBackend(model, mode="ref")


@pytest.mark.slow  # a benchmark script or a multi-process run: full tier only
def test_benchmark_script_runs_quick(tmp_path):
    """Smoke test so ``benchmarks/bench_trainside_generate.py`` can't rot (no timing asserted)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_trainside_generate.py"
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(script), "--quick", "--models", "tiny_h64_l2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {r["path"] for r in rows} == {
        "backend_sync1",
        "backend_sync16",
        "backend_legacy",
        "hf_generate",
        "hf_generate_logprobs",
    }
    assert all(0 < r["tokens"] <= 4 * 2 * 16 and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"]) for r in rows)


def test_list_of_eos_ids_from_the_generation_config():
    model = build_tiny_qwen3(VOCAB, seed=0)
    model.generation_config.eos_token_id = [2, 30, 31, 32, 33, 34, 35]  # Qwen configs list several
    backend = TransformersBackend(model)
    assert backend.eos_token_ids == (2, 30, 31, 32, 33, 34, 35)
    out = backend.generate(PROMPTS, 4, SamplingParams(max_new_tokens=40, temperature=1.5, seed=0))
    stopped = [c for c in out if c.finish_reason == "stop"]
    assert stopped and all(c.token_ids[-1] in backend.eos_token_ids for c in stopped)
    assert all(not set(c.token_ids[:-1]) & set(backend.eos_token_ids) for c in out)


# ----------------------------------------------------------------------------- multi-turn episodes
DELTAS = ([30, 31], [32, 33, 34, 35, 36], [37])  # a "tool answer" per turn, of varied lengths


def play_episodes(model, *, kept, turns=4, stops=(), max_batch_size=None, sync_every=None):
    """``turns`` turns of the PROMPTS and two more episodes, each continuing from its exact ids
    plus a tool delta; episode 1 ends after turn 1 (and is dropped from the cache). Returns per
    turn ``{episode: (context sent, completion)}``, and the episode cache (``kept``) or None."""
    backend = TransformersBackend(
        model, seed=5, max_batch_size=max_batch_size, sync_every=sync_every
    )
    contexts = [list(p) for p in [*PROMPTS, [40, 41, 42], [43] * 9]]
    active, cache, turns_played = list(range(len(contexts))), EpisodeCache(), []
    for turn in range(turns):
        sampling = SamplingParams(max_new_tokens=6, stop_token_ids=stops)  # the backend's stream
        ids = {"episodes": cache, "episode_ids": active} if kept else {}
        out = backend.generate([contexts[b] for b in active], 1, sampling, **ids)
        turns_played.append({b: (list(contexts[b]), c) for b, c in zip(active, out)})
        for b, c in zip(active, out):
            contexts[b] += c.token_ids + DELTAS[(b + turn) % len(DELTAS)]
        if turn == 1:
            active.remove(1)
            cache.drop([1])
    return turns_played, (cache if kept else None)


@pytest.mark.parametrize(
    ("stops", "max_batch_size"), [((), None), (tuple(range(40, 60)), None), ((), 2)]
)
def test_episodes_that_keep_their_kv_cache_give_the_re_prefilling_tokens(
    model, stops, max_batch_size, monkeypatch
):
    """Issue 31 item 2: a K-turn episode continued from its kept KV cache samples the same tokens
    (same seeds) as the path that re-prefills the whole context every turn, with the same
    log-probs (to float rounding: the prefix's keys/values come from another forward), and each
    turn forwards only the last ``q`` tokens of every context, ``q`` the most any context of its
    batch added (the last turn's last token and the tool delta): a row that added fewer forwards
    kept tokens again instead of padding, so that every kept row's positions are contiguous in
    the batch's cache and are kept as views (checked on every call), not copied."""
    import ar_torchrl.backends.transformers.backend as backend_module

    forwarded, kept_rows = [], []
    real_kept_states = backend_module.kept_states

    def spy(cache, rows, mask):  # the plain check: each row's real columns form one run
        for r in rows:
            cols = mask[r, : cache.layers[0].get_seq_length()].nonzero().squeeze(-1).tolist()
            kept_rows.append(cols == list(range(cols[0], cols[0] + len(cols))))
        out = real_kept_states(cache, rows, mask)
        storage = cache.layers[0].keys.untyped_storage().data_ptr()
        assert all(layers[0][0].untyped_storage().data_ptr() == storage for layers in out)
        return out

    monkeypatch.setattr(backend_module, "kept_states", spy)
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: forwarded.append(kw["input_ids"].numel()), with_kwargs=True
    )
    try:
        whole, _ = play_episodes(model, kept=False, stops=stops, max_batch_size=max_batch_size)
        n_whole, forwarded[:] = sum(forwarded), []
        kept, cache = play_episodes(model, kept=True, stops=stops, max_batch_size=max_batch_size)
        n_kept = sum(forwarded)
    finally:
        hook.remove()
    assert kept_rows and all(kept_rows)
    if stops:  # some turns stop early (rows dropped mid-turn), some run to the cap
        assert {c.finish_reason for turn in kept for _, c in turn.values()} == {"stop", "length"}
    for a, b in zip(whole, kept):
        assert a.keys() == b.keys()
        for episode, (context, c) in b.items():
            assert a[episode][0] == context and a[episode][1].token_ids == c.token_ids
            assert a[episode][1].finish_reason == c.finish_reason
            ref = reference_log_probs(model, context, c.token_ids, SamplingParams())
            torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-5, rtol=0)
    # what was kept of each episode: its last context and that turn's tokens but the last one;
    # of it, a turn loads what lies before the last q tokens of the context (per chunk of rows)
    reused, chunk = 0, max_batch_size or len(PROMPTS) + 2
    for k in range(1, 4):
        episodes = list(kept[k])
        for s in range(0, len(episodes), chunk):
            part = episodes[s : s + chunk]
            have = {e: len(kept[k - 1][e][0]) + len(kept[k - 1][e][1]) - 1 for e in part}
            q = max(len(kept[k][e][0]) - have[e] for e in part)
            reused += sum(max(len(kept[k][e][0]) - q, 0) for e in part)
    sent = sum(len(context) for turn in kept for context, _ in turn.values())
    assert (cache.reused_tokens, cache.prefilled_tokens) == (reused, sent - reused)
    assert cache.prefilled_tokens < sent / 2 and n_kept < n_whole / 2
    assert sorted(cache.states) == sorted(kept[-1])  # the episode that ended was dropped


def test_an_episode_whose_context_does_not_extend_its_kept_ids_is_prefilled_whole(model):
    backend, cache = TransformersBackend(model, seed=0), EpisodeCache()
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
    first = backend.generate(PROMPTS, 1, sampling, episodes=cache, episode_ids=[0, 1, 2])
    edited = [PROMPTS[0] + first[0].token_ids + [30], [99 - t for t in PROMPTS[1]] + [31]]
    out = backend.generate(edited, 1, sampling, episodes=cache, episode_ids=[0, 1])
    kept0 = len(PROMPTS[0]) + len(first[0]) - 1  # episode 1's context changed: a miss
    q = max(len(edited[0]) - kept0, len(edited[1]))  # the miss forwards its whole context
    assert cache.reused_tokens == len(edited[0]) - q
    assert cache.prefilled_tokens == sum(map(len, PROMPTS)) + 2 * q  # the first call: all
    for context, c in zip(edited, out):
        assert c.token_ids == backend.generate([context], 1, sampling)[0].token_ids
    backend.partial_rollouts = True  # a sync may come between two tokens: nothing is kept
    backend.generate(edited, 1, sampling, episodes=cache, episode_ids=[0, 1])
    assert len(cache) == 0


# ----------------------------------------------------------------------------- host reads
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reading_the_stop_condition_every_n_tokens_gives_the_same_tokens(model, temperature):
    """Issue 31 item 3: ``sync_every > 1`` reads the loop's state every n tokens (finished rows
    compute padding until then, and are dropped later): the same tokens at every interval, greedy
    also as the every-token loop, and log-probs that match a plain forward."""
    stops = (49, 18, 3) if temperature == 0 else tuple(range(40, 60))
    sampling = SamplingParams(max_new_tokens=16, temperature=temperature, stop_token_ids=stops)
    prompts = PROMPTS + [[p + 1 for p in row] for row in PROMPTS] + [[3, 4, 5], [60, 61]]
    runs = {
        every: TransformersBackend(model, seed=2, sync_every=every).generate(prompts, 2, sampling)
        for every in (1, 2, 5, 64)
    }
    assert len({len(c) for c in runs[1]}) > 1
    same = (1, 2, 5, 64) if temperature == 0 else (2, 5, 64)  # sampling: 1 keeps today's stream
    for every in same:
        assert [c.token_ids for c in runs[every]] == [c.token_ids for c in runs[same[0]]]
        assert [c.finish_reason for c in runs[every]] == [c.finish_reason for c in runs[same[0]]]
    for c in runs[5]:
        ref = reference_log_probs(model, prompts[c.prompt_index], c.token_ids, sampling)
        torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-5, rtol=0)
    kept, _ = play_episodes(model, kept=True, stops=tuple(range(40, 60)), sync_every=3)
    whole, _ = play_episodes(model, kept=False, stops=tuple(range(40, 60)), sync_every=3)
    assert [[c.token_ids for _, c in t.values()] for t in kept] == [
        [c.token_ids for _, c in t.values()] for t in whole
    ]
    for bad in (0, True, -2):
        with pytest.raises(ValueError, match=r"sync_every must be an int >= 1 .* got"):
            TransformersBackend(model, sync_every=bad)


def test_the_dense_mask_is_the_padding_mask_with_causality():
    from ar_torchrl.backends.transformers.backend import _dense_causal_mask

    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1]])
    dense = _dense_causal_mask(mask, 2)[:, 0]
    loop = torch.zeros(2, 2, 4, dtype=torch.bool)
    for b in range(2):
        for i in range(2):
            for j in range(4):
                loop[b, i, j] = bool(mask[b, j]) and j <= 2 + i  # query i sits at column 2 + i
    assert torch.equal(dense, loop)
    padded_query = _dense_causal_mask(torch.tensor([[0, 0, 1]]), 3)[0, 0]
    assert padded_query[0].all() and padded_query[1].all()  # no key to attend: attends to all
    assert padded_query[2].tolist() == [False, False, True]
