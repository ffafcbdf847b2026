"""Picking the next token from ``[B, V]`` logits, with the log-prob the PPO data needs.

The log-prob convention (the project's, SGLang's, what the trainer recomputes): ``log softmax(logits
/ T)`` of the *unfiltered* distribution, also under top-k/top-p (``"temperature"``), or the
filtered, renormalised sampling distribution (``"processed"``); greedy uses ``T = 1``.
"""

from __future__ import annotations

from typing import Literal

import torch

from ar_torchrl.backends.base import SamplingParams

__all__ = ["LogProbMode", "next_token_log_probs", "sample_next_token"]

LogProbMode = Literal["temperature", "processed"]


def next_token_log_probs(
    logits: torch.Tensor,
    sampling: SamplingParams,
) -> torch.Tensor:
    """Log-probs of the distribution the next token is sampled from (top-k/top-p applied).

    The logits are cast to float32, divided by the temperature (``T = 1`` when greedy), then
    filtered: top-k keeps the tokens whose logit is ``>=`` the k-th largest (ties at the boundary are
    kept), top-p (SGLang's rule) keeps, in descending probability order, every token whose
    preceding cumulative probability is ``< top_p`` (so at least one token). Removed tokens get
    ``-inf`` and the rest is renormalised with ``log_softmax``. Greedy (``temperature == 0``) applies
    no filter: it returns ``log_softmax(logits)``.

    Args:
        logits: ``[B, V]`` next-token logits.
        sampling: temperature / top-k / top-p.

    Returns:
        ``[B, V]`` float32 log-probs (``-inf`` for filtered tokens).

    Example:
        >>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
        >>> lp = next_token_log_probs(logits, SamplingParams(temperature=1.0, top_k=2))
        >>> [round(p, 4) for p in lp.exp()[0].tolist()]
        [0.7311, 0.2689, 0.0, 0.0]
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k != -1 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove_sorted = mass_before >= sampling.top_p
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample_next_token(
    logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    logprob_mode: LogProbMode = "temperature",
    rows: torch.Tensor | None = None,
    batch: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample (or, greedy, pick) one token per row and return its log-prob.

    Without top-k/top-p the log-prob is ``scaled[token] - logsumexp(scaled)`` (``scaled = logits /
    T``), computed from the pass that gives the sampling weights: no ``[B, V]`` log-softmax is
    materialised. The tokens drawn are those of ``torch.multinomial`` on the softmax (the weights
    are not normalised: multinomial normalises them itself).

    Args:
        logits: ``[B, V]`` next-token logits (any float dtype; computed in float32).
        sampling: temperature / top-k / top-p (``temperature == 0``: greedy, ``argmax(logits)``).
        generator: RNG of the draw.
        logprob_mode: see the module docstring.
        rows, batch: draws that do not depend on which rows of a batch are still computed: the
            noise is drawn for all ``batch`` rows and row ``i`` of ``logits`` (batch row
            ``rows[i]``) takes that of ``rows[i]`` (the exponential race ``argmax(w / E)``,
            ``E ~ Exp(1)``: the same law as ``torch.multinomial``). ``None``: multinomial.

    Returns:
        tokens ``[B]`` (long) and their float32 log-probs ``[B]``.

    Example:
        >>> logits = torch.tensor([[2.0, 1.0, 0.0]])
        >>> tok, lp = sample_next_token(logits, SamplingParams(temperature=0.0))
        >>> tok.tolist(), round(lp.item(), 4), round(torch.log_softmax(logits, -1)[0, 0].item(), 4)
        ([0], -0.4076, -0.4076)
    """
    logits = logits.float()
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens, picked - torch.logsumexp(logits, dim=-1)
    scaled = logits / sampling.temperature
    if sampling.top_k == -1 and sampling.top_p == 1.0:
        top = scaled.amax(dim=-1, keepdim=True)
        weights = (scaled - top).exp_()
        tokens = _draw(weights, generator, rows, batch).unsqueeze(-1)
        log_z = top.squeeze(-1) + weights.sum(dim=-1).log()
        return tokens.squeeze(-1), scaled.gather(-1, tokens).squeeze(-1) - log_z
    log_probs = next_token_log_probs(logits, sampling)
    tokens = _draw(log_probs.exp(), generator, rows, batch)
    if logprob_mode == "temperature":  # the unfiltered T-scaled distribution
        picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens, picked - torch.logsumexp(scaled, dim=-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _draw(
    weights: torch.Tensor,
    generator: torch.Generator | None,
    rows: torch.Tensor | None,
    batch: int | None,
) -> torch.Tensor:
    """One index per row of ``[B, V]`` non-negative weights, ``[B]`` (see ``sample_next_token``)."""
    if rows is None:
        return torch.multinomial(weights, 1, generator=generator).squeeze(-1)
    noise = torch.empty((batch, weights.shape[-1]), device=weights.device, dtype=weights.dtype)
    noise.exponential_(generator=generator).clamp_(min=torch.finfo(weights.dtype).tiny)
    return (weights / noise.index_select(0, rows)).argmax(dim=-1)
