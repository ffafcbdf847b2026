"""ToolEnv against a real SGLang server: 2- and 3-turn episodes are token-in/token-out.

The server serves the session's tiny Qwen3 (char tokenizer, vocab 99), loaded with known weights
first. A random model never writes a tool call, so the episodes use a test call format, a real
:class:`~ar_torchrl.tools.CallParser` on the protocol, that reads *every* turn as a call to an
``echo`` tool (its answer: the length of the turn's text); half of the vocabulary is given as
stop tokens so that turns end in a few tokens (``finish_reason="stop"``), and ``max_turns`` cuts
the episodes at 2 or 3 turns. What is checked is the engine side, not the parser: each request's
``input_ids`` are exactly the episode's ids so far; the trajectory is exactly the sampled tokens
plus the template's tool deltas; the server's log-probs equal the trainer's fp32 ones within 1e-4
on every trained token; the first PPO update has ratio exactly 1 and reaches the value head.
"""

from __future__ import annotations

import pytest
import torch
from support.sglang_helpers import trainer_log_probs, trainer_with_value_head
from support.tool_doubles import Echo, EveryTurnIsACall
from support.trajectories import first_update_has_ratio_one

from ar_torchrl.backends import SamplingParams
from ar_torchrl.backends.sglang import SGLangBackend
from ar_torchrl.data.tasks import tool_arithmetic_rows
from ar_torchrl.envs import ToolEnv
from ar_torchrl.models import build_char_tokenizer
from ar_torchrl.modules import LMActorCritic
from ar_torchrl.rewards.math import ArithmeticReward
from ar_torchrl.tools import Toolbox
from ar_torchrl.tools.template import tool_delta_ids
from ar_torchrl.training import plan_micro_batches
from ar_torchrl.weight_sync import named_policy_tensors

VERSION = 700


class Recording:
    """The real backend, with every ``generate`` call's prompts and completions kept."""

    def __init__(self, backend) -> None:
        self.backend, self.calls = backend, []
        self.generate_real = backend.generate
        backend.generate = self.generate

    def generate(self, prompts, n, sampling):
        out = self.generate_real(prompts, n, sampling)
        self.calls.append(([list(p) for p in prompts], out))
        return out


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("max_turns", [2, 3])
def test_real_server_multi_turn_episodes_are_token_in_token_out(sglang_server, max_turns):
    tok = build_char_tokenizer()
    model = trainer_with_value_head(seed=71)
    backend = SGLangBackend(sglang_server.url, timeout_s=120, vocab_size=99, show_progress=False)
    try:
        backend.sync_weights(named_policy_tensors(model), version=VERSION)
        recording = Recording(backend)
        stop = tuple(i for i in range(3, 99, 2) if i != tok.pad_token_id)
        env = ToolEnv(
            tool_arithmetic_rows(4, seed=3),
            tok,
            backend,
            toolbox=Toolbox([Echo()], EveryTurnIsACall()),
            reward_fn=ArithmeticReward(),
            num_samples=2,
            prompts_per_batch=2,
            sampling=SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=stop),
            max_turns=max_turns,
            max_total_tokens=480,
        )
        td = env.collect()
    finally:
        backend.close()

    assert td.shape[0] == 4 and len(recording.calls) == max_turns  # one request batch per turn
    assert all(len(prompts) == 4 for prompts, _ in recording.calls)  # no episode ended early
    for b in range(4):
        # the episode as the engine saw it, turn by turn
        ids = list(recording.calls[0][0][b])
        trained, deltas = [], []
        for k in range(max_turns):
            prompts, out = recording.calls[k]
            assert prompts[b] == ids, f"row {b} turn {k}: the request is not the episode so far"
            c = out[b]
            assert c.finish_reason == "stop" and c.policy_version == VERSION
            trained += list(range(len(ids), len(ids) + len(c.token_ids)))
            ref = trainer_log_probs(model, ids, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.log_probs), ref, atol=1e-4, rtol=0)
            ids += c.token_ids
            if k + 1 < max_turns:
                text = tok.decode(c.token_ids, skip_special_tokens=True)
                delta = tool_delta_ids(
                    tok,
                    [str(len(text))],
                    include_end_of_turn=c.token_ids[-1] != tok.eos_token_id,
                )
                deltas.append(delta)
                ids += delta
        row = td[b]
        real = row["attention_mask"]
        assert row["tokens"][real].tolist() == ids  # sampled tokens + the template's deltas
        mask = row["loss_mask"][real]
        assert mask.nonzero().squeeze(-1).tolist() == trained  # deltas and prompt untrained
        turn_id = row["turn_id"][real]
        assert sorted(set(turn_id[mask].tolist())) == list(range(max_turns))
        assert (turn_id[~mask] == -1).all()
        # the trajectory's rollout log-probs are the server's, on every trained token
        served = torch.cat([torch.tensor(out[b].log_probs) for _, out in recording.calls])
        torch.testing.assert_close(row["rollout_log_prob"][real][mask], served, atol=0, rtol=0)
        # ... and the trainer's fp32 log-probs of the whole sequence agree within 1e-4
        full = torch.tensor([ids])
        with torch.no_grad():
            logits = model(full).logits[0, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, full[0, 1:, None])[:, 0]
        torch.testing.assert_close(served, ref[mask[1:]], atol=1e-4, rtol=0)
        assert td[b]["next", "truncated"][real].any()  # cut by max_turns (it called on its last)

    # first PPO update on the trajectory: ratio exactly 1, the critic gets a gradient
    plan = plan_micro_batches(td, token_budget=2 * td.batch_size[1])
    first_update_has_ratio_one(LMActorCritic(model), td, plan)
    assert model.value_head.weight.grad.norm() > 0
