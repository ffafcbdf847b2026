"""Value head and LMActorCritic."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from support.trajectories import VOCAB, make_trajectory, tiny_actor_critic
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from ar_torchrl.models.tiny import build_tiny_qwen3
from ar_torchrl.modules import (
    LMActorCritic,
    attach_value_head,
    chunk_tokens_for_budget,
    load_value_head,
    save_policy,
    token_log_probs,
)

torch.set_num_threads(1)


def test_value_head_is_zero_fp32_and_named_like_hf():
    model = attach_value_head(build_tiny_qwen3(VOCAB))
    hf_keys = set(build_tiny_qwen3(VOCAB).state_dict())
    assert set(model.state_dict()) == hf_keys | {"value_head.weight", "value_head.bias"}
    assert model.value_head.weight.dtype == torch.float32
    assert model.value_head.weight.abs().sum() == 0 and model.value_head.bias.abs().sum() == 0
    assert attach_value_head(model) is model  # idempotent, keeps the head


def test_value_head_survives_save_pretrained_round_trip(tmp_path):
    model = attach_value_head(build_tiny_qwen3(VOCAB, seed=1))
    torch.nn.init.normal_(model.value_head.weight)
    save_policy(model, tmp_path)
    # model.safetensors is a clean HF checkpoint; the head lives in its own file
    assert not any(
        k.startswith("value_head") for k in load_file(str(tmp_path / "model.safetensors"))
    )
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not hasattr(plain, "value_head")
    again = attach_value_head(plain, tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    fresh = attach_value_head(AutoModelForCausalLM.from_pretrained(tmp_path))
    assert fresh.value_head.weight.abs().sum() == 0  # plain checkpoint -> zero head


def test_load_value_head_errors(tmp_path):
    model = build_tiny_qwen3(VOCAB)
    with pytest.raises(FileNotFoundError, match="no value head at .*value_head.safetensors"):
        load_value_head(model, tmp_path)
    with pytest.raises(ValueError, match="has no `value_head`; call .*attach_value_head"):
        LMActorCritic(model)


def test_log_probs_match_plain_hf_forward_with_left_padding():
    ac = tiny_actor_critic(seed=3, return_entropy=True, logits_chunk_tokens=7)
    td = make_trajectory([3, 5, 1], [4, 2, 6], seed=1)
    out = ac(td.select("tokens", "attention_mask"))
    for b in range(td.shape[0]):
        real = td["attention_mask"][b].nonzero().flatten()
        ids = td["tokens"][b, real].unsqueeze(0)
        logits = ac.model(input_ids=ids).logits.float()
        ref = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        assert torch.allclose(out["log_prob"][b, real[1:]], ref, atol=1e-5)
        probs = torch.softmax(logits[0, :-1], -1)
        ent = -(probs * probs.log()).sum(-1)
        assert torch.allclose(out["entropy"][b, real[1:]], ent, atol=1e-5)
    assert out["state_value"].shape == (3, td.shape[1], 1)
    assert out["state_value"].abs().sum() == 0


def test_state_value_alignment_and_next_value():
    ac = tiny_actor_critic(seed=0)
    torch.nn.init.normal_(ac.model.value_head.weight)
    td = TensorDict(
        {
            "tokens": torch.randint(3, VOCAB, (2, 5)),
            "attention_mask": torch.ones(2, 5, dtype=torch.bool),
        },
        [2, 5],
    )
    out = ac(td)
    hidden = ac.hidden_states(td["tokens"], td["attention_mask"])
    v = ac.model.value_head(hidden)
    assert torch.equal(out["state_value"][:, 1:], v[:, :-1])  # V(s_t) from h[t-1]
    assert (out["state_value"][:, 0] == 0).all()
    assert torch.equal(out["next", "state_value"], v)


def test_chunked_log_probs_match_unchunked_and_gradients_flow():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(3, 9, 8, requires_grad=True)
    tokens = torch.randint(11, (3, 9))
    full, ent_full = token_log_probs(
        hidden, tokens, head, chunk_tokens=10_000, with_entropy=True, use_checkpoint=False
    )
    chunked, ent = token_log_probs(
        hidden, tokens, head, chunk_tokens=4, with_entropy=True, temperature=1.0
    )
    assert torch.allclose(full, chunked, atol=1e-6) and torch.allclose(ent_full, ent, atol=1e-6)
    (chunked.sum() + ent.sum()).backward()
    g1 = hidden.grad.clone()
    hidden.grad = None
    (full.sum() + ent_full.sum()).backward()
    assert torch.allclose(g1, hidden.grad, atol=1e-6)
    hot, _ = token_log_probs(hidden.detach(), tokens, head, temperature=0.5)
    ref = (
        torch.log_softmax(head(hidden.detach()[:, :-1]) / 0.5, -1)
        .gather(-1, tokens[:, 1:, None])
        .squeeze(-1)
    )
    assert torch.allclose(hot[:, 1:], ref, atol=1e-5)


def test_chunk_size_follows_the_memory_budget_and_vocabulary():
    # k = 5 float32 [chunk, V] buffers per chunk, whatever the mode (anchors and training alike)
    assert chunk_tokens_for_budget(151_936, 2**30) == 2**30 // (151_936 * 4 * 5) == 353
    assert chunk_tokens_for_budget(1000, 60_000) == 3
    assert chunk_tokens_for_budget(10**6, 1) == 1  # never 0
    with pytest.raises(ValueError, match="vocab_size and memory_budget must be >= 1, got 0"):
        chunk_tokens_for_budget(0, 2**20)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden, tokens = torch.randn(2, 9, 8), torch.randint(50, (2, 9))
    ref, _ = token_log_probs(hidden, tokens, head, chunk_tokens=10_000)
    for budget in (50 * 4 * 5, 50 * 4 * 5 * 7, 2**30):  # 1, 7 and all positions per chunk
        lp, _ = token_log_probs(hidden, tokens, head, memory_budget=budget)
        assert torch.allclose(lp, ref, atol=1e-6)


@pytest.mark.parametrize("entropy", [False, True])
def test_actor_critic_results_do_not_depend_on_the_chunking(entropy):
    td = make_trajectory([3, 5, 1], [4, 2, 6], seed=2).select("tokens", "attention_mask")
    outs, grads = [], []
    for kwargs in ({}, {"logits_memory_budget": VOCAB * 4 * 5 * 2}, {"logits_chunk_tokens": 3}):
        ac = tiny_actor_critic(seed=4, return_entropy=entropy, **kwargs)
        out = ac(td.clone())
        loss = out["log_prob"].sum() + (out["entropy"].sum() if entropy else 0.0)
        loss.backward()
        outs.append(out)
        grads.append(ac.model.model.embed_tokens.weight.grad)
    for out, grad in zip(outs[1:], grads[1:]):
        assert torch.allclose(out["log_prob"], outs[0]["log_prob"], atol=1e-6)
        assert torch.allclose(grad, grads[0], atol=1e-5, rtol=1e-5)
        if entropy:
            assert torch.allclose(out["entropy"], outs[0]["entropy"], atol=1e-6)


def test_actor_critic_errors_and_keys():
    ac = tiny_actor_critic()
    with pytest.raises(ValueError, match=r"of one shape \[B, L\]; got \(2, 3\) and \(2, 4\)"):
        ac(
            TensorDict(
                {"tokens": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 4)},
                [2],
            )
        )
    with pytest.raises(KeyError, match="unknown key name 'bogus'"):
        ac.set_keys(bogus="x")
    ac.set_keys(tokens=("data", "ids"), log_prob="lp")
    td = TensorDict(
        {
            ("data", "ids"): torch.randint(3, VOCAB, (1, 4)),
            "attention_mask": torch.ones(1, 4, dtype=torch.bool),
        },
        [1, 4],
    )
    assert ac(td)["lp"].shape == (1, 4)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        tiny_actor_critic(temperature=0.0)


def test_actor_without_value_head_and_accepted_keys():
    """critic=False runs a bare HF model (no value head) and writes no value key."""
    bare = build_tiny_qwen3(VOCAB, seed=2)
    actor = LMActorCritic(bare, critic=False, return_entropy=True)
    td = make_trajectory([3, 2], [2, 4], seed=0).select("tokens", "attention_mask")
    out = actor(td.clone())
    assert set(out.keys()) == {"tokens", "attention_mask", "log_prob", "entropy"}
    full = LMActorCritic(attach_value_head(bare))(td.clone())  # same backbone: same log-probs
    assert torch.equal(out["log_prob"], full["log_prob"])
    actor.set_keys(value=("critic", "v"))  # next_value follows value
    assert actor.tensor_keys.next_value == ("next", "critic", "v") and actor.value_key == (
        "critic",
        "v",
    )
    assert actor.out_keys == ["log_prob", "entropy"]
    with pytest.raises(TypeError, match="LMActorCritic: critic must be true or false, got 'no'"):
        LMActorCritic(bare, critic="no")
    with pytest.raises(ValueError, match="LMActorCritic: logits_chunk_tokens must be >= 1, got 0"):
        LMActorCritic(bare, critic=False, logits_chunk_tokens=0)


def test_return_entropy_is_a_public_setting_that_updates_out_keys():
    """What TokenPPOLoss(entropy_coeff > 0) flips: setting it changes out_keys and the forward."""
    from ar_torchrl.objectives import TokenPPOLoss

    ac = tiny_actor_critic(seed=0)
    td = make_trajectory([3, 2], [2, 4], seed=0).select("tokens", "attention_mask")
    assert "entropy" not in ac.out_keys and "entropy" not in ac(td.clone()).keys()
    ac.return_entropy = True
    assert ac.out_keys[-1] == "entropy" and ac(td.clone())["entropy"].shape == td.shape
    ac.return_entropy = False
    assert "entropy" not in ac.out_keys
    with pytest.raises(TypeError, match="LMActorCritic: return_entropy must be true or false"):
        ac.return_entropy = "yes"
    TokenPPOLoss(ac, entropy_coeff=0.01)  # the loss asks its actor for entropies
    assert ac.return_entropy and "entropy" in ac.out_keys
