"""Partial rollouts: a weight sync interrupts generation in flight, the rest of each response is
sampled by the new weights, every token keeps the version and log-prob of the weights that sampled
it, and the trajectory, the anchors and the correction weights use each token's own numbers."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from support.scripted_backend import PausingBackend
from tensordict import TensorDict

from ar_torchrl.backends import SamplingParams, TransformersBackend
from ar_torchrl.data.samples import Sample, Segment, sample_from_completion
from ar_torchrl.data.trajectory import build_trajectory
from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import LMActorCritic, attach_value_head
from ar_torchrl.objectives import TokenGAE, TokenPPOLoss
from ar_torchrl.training import plan_micro_batches, recompute_old_log_probs_and_values
from ar_torchrl.weight_sync import named_policy_tensors

torch.set_num_threads(1)
VOCAB = 99
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _log_probs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's log-prob of each token given the prompt and the tokens before it."""
    ids = torch.tensor([prompt + tokens])
    td = TensorDict({"tokens": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)}, [1])
    td.batch_size = ids.shape
    with torch.no_grad():
        lp = LMActorCritic(model, critic=False)(td)["log_prob"][0]
    return lp[len(prompt) :].tolist()


def test_a_sync_splits_responses_and_every_token_keeps_its_version_and_log_prob():
    old = build_tiny_qwen3(VOCAB, seed=0, eos_token_id=VOCAB + 5)  # no EOS: full length
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    backend = PausingBackend(old, pause_after=4, seed=0)  # prefill + 3 decode steps, then the sync
    backend.partial_rollouts = True
    result = {}
    worker = threading.Thread(
        target=lambda: result.setdefault(
            "out", backend.generate(PROMPTS, 2, SamplingParams(max_new_tokens=10))
        )
    )
    worker.start()
    assert backend.reached.wait(60)
    backend.sync_weights(named_policy_tensors(new), version=1)  # interrupts, then loads
    worker.join(60)
    out = result["out"]
    assert backend.policy_version == 1 and backend.interruptions == 1
    for c in out:
        assert len(c) == 10 and c.finish_reason == "length"
        assert c.token_versions == [0] * 4 + [1] * 6 and c.policy_version == 0
        prompt = PROMPTS[c.prompt_index]
        by_old, by_new = _log_probs(old, prompt, c.token_ids), _log_probs(new, prompt, c.token_ids)
        for t, (lp, v) in enumerate(zip(c.log_probs, c.token_versions)):
            want = by_old[t] if v == 0 else by_new[t]
            assert lp == pytest.approx(want, abs=1e-5), (c.prompt_index, t, v)
        assert any(abs(a - b) > 1e-3 for a, b in zip(by_old[4:], by_new[4:]))  # the weights differ
    # the trajectory: per-token versions on trained tokens, the correction uses each token's own
    # log-prob (rollout_log_prob), the anchors come from the trainer's current weights
    samples = [sample_from_completion(PROMPTS[c.prompt_index], c) for c in out]
    with pytest.raises(ValueError, match=r"one batch mixes policy versions \[0, 1\]"):
        build_trajectory(samples, pad_token_id=0)
    td = build_trajectory(samples, pad_token_id=0, allow_mixed_versions=True)
    mask = td["loss_mask"]
    assert td["policy_version"][mask].tolist() == [v for c in out for v in c.token_versions]
    assert (td["policy_version"][~mask] == 0).all()  # the row's oldest version elsewhere
    assert torch.equal(
        td["rollout_log_prob"][mask], torch.tensor([x for c in out for x in c.log_probs])
    )
    actor = LMActorCritic(attach_value_head(copy.deepcopy(new)))
    plan = plan_micro_batches(td, token_budget=1000)
    loss = TokenPPOLoss(actor, tis_cap=2.0)
    recompute_old_log_probs_and_values(actor, td, plan, loss=loss)
    td = TokenGAE(gamma=1.0, lmbda=0.95)(td)
    metrics = loss(td)
    ratio = (td["sample_log_prob"] - td["rollout_log_prob"]).exp()[mask]
    version = td["policy_version"][mask]
    assert torch.allclose(ratio[version == 1], torch.ones(int((version == 1).sum())), atol=1e-4)
    assert (ratio[version == 0] - 1).abs().max() > 1e-3  # the old tokens are off-policy
    assert metrics["tis_weight_mean"].item() == pytest.approx(
        ratio.clamp(max=2.0).mean().item(), rel=1e-5
    )


def test_without_partial_rollouts_a_sync_waits_for_the_generation():
    model = build_tiny_qwen3(VOCAB, seed=0, eos_token_id=VOCAB + 5)
    backend = TransformersBackend(model, seed=0)
    started, finished = threading.Event(), []
    original = backend._forward

    def forward(*args):
        started.set()
        return original(*args)

    backend._forward = forward
    worker = threading.Thread(
        target=lambda: finished.append(
            backend.generate(PROMPTS, 1, SamplingParams(max_new_tokens=8))
        )
    )
    worker.start()
    assert started.wait(60)
    backend.sync_weights(named_policy_tensors(model), version=1)  # waits for the whole batch
    worker.join(60)
    assert all(c.policy_version == 0 and c.token_versions is None for c in finished[0])
    assert backend.interruptions == 0


def test_partial_rollouts_need_an_engine_that_supports_them():
    from ar_torchrl.backends import Completion, GenerationBackend

    class Echo(GenerationBackend):
        def _generate(self, prompts, n, sampling):
            return [Completion(i, p[-1:], [0.0], "length") for i, p in enumerate(prompts)]

    with pytest.raises(ValueError, match=r"Echo cannot interrupt its generation"):
        Echo().partial_rollouts = True


def test_a_segment_with_token_versions_of_the_wrong_length_is_refused():
    bad = Sample([Segment([1, 2]), Segment([3, 4], True, [-0.1, -0.2], 0, token_versions=[0])])
    with pytest.raises(ValueError, match=r"a segment of 2 tokens with 1 token versions"):
        build_trajectory([bad], pad_token_id=0, allow_mixed_versions=True)
