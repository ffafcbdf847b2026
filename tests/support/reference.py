"""Plain, obviously-correct loop references for the numerical functions (tests only)."""

from __future__ import annotations

import math

import torch


def gae_loop(reward, value, mask, gamma, lmbda, critic_lmbda=None, bootstrap=None):
    """Row by row, token by token, exactly as docs/design.md section 3 words it (float64)."""
    B, L = reward.shape
    adv = torch.zeros(B, L, dtype=torch.float64)
    tgt = torch.zeros(B, L, dtype=torch.float64)
    for b in range(B):
        lam = float(lmbda[b]) if torch.is_tensor(lmbda) and lmbda.ndim else float(lmbda)
        if critic_lmbda is None:
            clam = lam
        else:
            clam = (
                float(critic_lmbda[b])
                if torch.is_tensor(critic_lmbda) and critic_lmbda.ndim
                else float(critic_lmbda)
            )
        v_next = 0.0 if bootstrap is None else float(bootstrap[b])
        a_next = 0.0
        c_next = 0.0
        for t in reversed(range(L)):
            if not mask[b, t]:
                continue
            r, v = float(reward[b, t]), float(value[b, t])
            delta = r + gamma * v_next - v
            a = delta + gamma * lam * a_next
            c = delta + gamma * clam * c_next
            adv[b, t] = a
            tgt[b, t] = c + v
            v_next, a_next, c_next = v, a, c
    return adv, tgt


def grpo_loop(seq_reward, group_id, scale=True, eps=1e-6):
    B = seq_reward.shape[0]
    out = torch.zeros(B, dtype=torch.float64)
    for i in range(B):
        members = [float(seq_reward[j]) for j in range(B) if int(group_id[j]) == int(group_id[i])]
        mean = sum(members) / len(members)
        if all(m == members[0] for m in members):
            continue
        var = sum((m - mean) ** 2 for m in members) / (len(members) - 1)
        out[i] = (float(seq_reward[i]) - mean) / ((var**0.5 + eps) if scale else 1.0)
    return out


def aggregate_loop(loss, mask, mode, norm_length=None):
    rows = []
    total, count = 0.0, 0
    for b in range(loss.shape[0]):
        vals = [float(loss[b, t]) for t in range(loss.shape[1]) if mask[b, t]]
        total += sum(vals)
        count += len(vals)
        if vals:
            if mode == "seq_mean_token_mean":
                rows.append(sum(vals) / len(vals))
            elif mode == "seq_mean_token_sum":
                rows.append(sum(vals))
            elif mode == "seq_mean_token_sum_norm":
                rows.append(sum(vals) / norm_length)
    if mode == "token_mean":
        return total / max(count, 1)
    return sum(rows) / max(len(rows), 1)


def random_trajectory_masks(B, L, generator, gaps=True):
    """Ragged left-padded prompt + response masks; optional masked 'tool' gaps inside responses."""
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        start = int(torch.randint(1, max(2, L // 2), (1,), generator=generator))
        end = int(torch.randint(start, L + 1, (1,), generator=generator))
        mask[b, start:end] = True
        if gaps and end - start > 4 and bool(torch.rand(1, generator=generator) < 0.5):
            g = int(torch.randint(start + 1, end - 1, (1,), generator=generator))
            mask[b, g : g + 2] = False
    return mask


def surrogate_loop(lp, old, adv, mask, clip_low, clip_high, dual_clip=None, bound=20.0):
    """Per-token clipped PPO loss in Python floats (float64), log-ratio clamped to +-bound."""
    out = torch.zeros(lp.shape, dtype=torch.float64)
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            lr = min(max(float(lp[b, t]) - float(old[b, t]), -bound), bound)
            r, a = math.exp(lr), float(adv[b, t])
            loss = max(-r * a, -min(max(r, 1 - clip_low), 1 + clip_high) * a)
            if dual_clip is not None and a < 0:
                loss = min(loss, -dual_clip * a)
            out[b, t] = loss
    return out


def whiten_loop(x, mask):
    """(x - mean) / sqrt(var + 1e-8) over mask with the n - 1 (unbiased) variance; 0 elsewhere."""
    vals = [float(v) for v, m in zip(x.flatten(), mask.flatten()) if m]
    n = len(vals)
    mean = sum(vals) / max(n, 1)
    var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
    out = [
        (float(v) - mean) / math.sqrt(var + 1e-8) if m else 0.0
        for v, m in zip(x.flatten(), mask.flatten())
    ]
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def explained_variance_loop(value, target, mask):
    """1 - Var[t - v] / Var[t] over mask; sklearn's force_finite rule when Var[t] == 0; 0 if empty."""
    pairs = [
        (float(v), float(t))
        for v, t, m in zip(value.flatten(), target.flatten(), mask.flatten())
        if m
    ]
    if not pairs:
        return 0.0

    def var(xs):
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    def is_zero(variance, xs):  # below float64 eps x mean square: rounding, not spread
        return variance <= 2.220446049250313e-16 * sum(x * x for x in xs) / len(xs)

    targets, errors = [t for _, t in pairs], [t - v for v, t in pairs]
    var_t, var_err = var(targets), var(errors)
    if is_zero(var_t, targets):
        return 1.0 if is_zero(var_err, errors) else 0.0
    return 1.0 - var_err / var_t
