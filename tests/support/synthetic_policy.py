"""A synthetic policy whose explained-variance ceilings are known in closed form (a Bernoulli tree).

Prompt rows are of two types (``"A"``, ``"B"``; equal numbers of rows). A response is three trained
tokens: a first step ``x`` (probability ``alpha``) or ``y``, then ``c`` (correct, with probability
``beta_x`` or ``beta_y`` given the first step) or ``w``, then EOS. The reward is +1 after ``c``, -1
after ``w`` (outcome only, so every trained token's return is the reward).

States of the trained tokens: the prompt (first token), the prompt + first step (second token), the
prompt + both steps (EOS: the reward is decided, no variance). With ``p_j = alpha beta_x +
(1 - alpha) beta_y`` and ``v(q) = 4 q (1 - q)`` (the variance of a +-1 reward right with
probability ``q``):

- ``Var(R) = v(mean_j p_j)`` (tokens split evenly between the types);
- token level: ``E[Var(R | s)] = mean_j [v(p_j) + alpha v(beta_x) + (1 - alpha) v(beta_y) + 0] / 3``;
- prompt level (one return per sample): ``E[Var(R | prompt)] = mean_j v(p_j)``.
"""

from __future__ import annotations

import math
import random

import torch

from ar_torchrl.backends import Completion, GenerationBackend

#: type -> (alpha, beta_x, beta_y)
TREE = {"A": (0.8, 0.9, 0.2), "B": (0.3, 0.6, 0.05)}


def _v(q: float) -> float:
    return 4.0 * q * (1.0 - q)


def analytic_ceilings(tree: dict = TREE) -> dict[str, float]:
    """The closed-form token- and prompt-level ceilings of ``tree`` (see the module docstring), and
    the within-prompt one: every prompt has the same number of tokens, so ``E[Var(R | prompt)]``
    over tokens is ``prompt_within``."""
    p = {j: a * bx + (1 - a) * by for j, (a, bx, by) in tree.items()}
    total = _v(sum(p.values()) / len(p))
    after_step = {j: a * _v(bx) + (1 - a) * _v(by) for j, (a, bx, by) in tree.items()}
    token_within = sum(_v(p[j]) + after_step[j] for j in tree) / (3 * len(tree))
    prompt_within = sum(_v(q) for q in p.values()) / len(p)
    return {
        "token": 1 - token_within / total,
        "prompt": 1 - prompt_within / total,
        "within_prompt": 1 - token_within / prompt_within,
    }


def sample_tree(
    rows: int, k: int, generator: torch.Generator, tree: dict = TREE
) -> dict[str, torch.Tensor]:
    """``rows`` prompt rows (alternating types) x ``k`` samples as ceiling inputs: per trained token
    ``returns``, ``states`` (row, prefix) and ``clusters`` (row); per sample ``sample_returns``
    and ``sample_prompts``."""
    params = torch.tensor([tree[t] for t in sorted(tree)], dtype=torch.float64)
    kind = torch.arange(rows) % len(tree)
    alpha, bx, by = params[kind].unbind(-1)  # [rows]
    first_x = torch.rand(rows, k, generator=generator, dtype=torch.float64) < alpha[:, None]
    beta = torch.where(first_x, bx[:, None], by[:, None])
    right = torch.rand(rows, k, generator=generator, dtype=torch.float64) < beta
    reward = right.double() * 2 - 1  # [rows, k]
    row = torch.arange(rows)[:, None].expand(rows, k)
    step = (~first_x).long()  # 0: x, 1: y
    prefix = torch.stack([torch.zeros_like(step), 1 + step, 3 + 2 * step + (~right).long()], -1)
    states = row[..., None] * 10 + prefix  # [rows, k, 3]: prompt, + step, + step + outcome
    return {
        "returns": reward[..., None].expand(rows, k, 3).reshape(-1),
        "states": states.reshape(-1),
        "clusters": row[..., None].expand(rows, k, 3).reshape(-1),
        "sample_returns": reward.reshape(-1),
        "sample_prompts": row.reshape(-1),
    }


def tree_reward(text: str, ground_truth: str) -> float:
    """The tree's reward as an env reward: +1 when the second step is ``c``."""
    return 1.0 if text[1:2] == "c" else -1.0


def tree_rows(rows: int) -> list[dict]:
    """DAPO-schema rows ``A0, B1, A2, ...`` (distinct prompts, alternating types)."""
    kinds = sorted(TREE)
    return [
        {
            "prompt": [{"role": "user", "content": f"{kinds[i % len(kinds)]}{i}"}],
            "reward_model": {"ground_truth": "c"},
        }
        for i in range(rows)
    ]


class BernoulliTreeBackend(GenerationBackend):
    """Test double of a rollout engine that samples :data:`TREE` (the real protocol: prompt-major,
    ``n`` per prompt, one log-prob per token, EOS kept with ``"stop"``): the synthetic policy whose
    ceilings :func:`analytic_ceilings` gives, which no language model could be made to follow."""

    def __init__(self, tokenizer, seed: int = 0, tree: dict = TREE):
        super().__init__(None)
        self.tokenizer, self.tree, self.rng = tokenizer, tree, random.Random(seed)

    def _generate(self, prompts, n, sampling):
        out = []
        for i, prompt in enumerate(prompts):
            text = self.tokenizer.decode(prompt, skip_special_tokens=True)
            kind = next(t for t in self.tree if f"user\n{t}" in text)
            alpha, bx, by = self.tree[kind]
            for _ in range(n):
                first = "x" if self.rng.random() < alpha else "y"
                beta = bx if first == "x" else by
                second = "c" if self.rng.random() < beta else "w"
                probs = [alpha if first == "x" else 1 - alpha, beta if second == "c" else 1 - beta]
                ids = self.tokenizer(first + second, add_special_tokens=False)["input_ids"]
                out.append(
                    Completion(
                        i,
                        [*ids, self.tokenizer.eos_token_id],
                        [math.log(q) for q in probs] + [0.0],
                        "stop",
                    )
                )
        return out
