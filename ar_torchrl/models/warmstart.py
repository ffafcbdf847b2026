"""Supervised warm start on generated problems in the DAPO prompt format, cached on disk.

A tiny random model cannot discover the ``Answer: $Answer`` format by RL alone (docs/design.md section 5):
a few hundred supervised steps on responses ``"Answer: X"`` that are correct only part of the time
teach the format but leave the arithmetic to PPO. The result is saved as an HF directory (so a
rollout server can load it too) under ``cache_dir/warmstart-<hash>``, where the hash covers the
initial weights, the tokenizer, the rows and every setting: a second run with the same inputs loads
the cached model instead of training again. Writes are atomic (temp dir + rename).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PreTrainedModel

from ar_torchrl.models.hf import check_tokenizer
from ar_torchrl.utils.checks import check_warm_start_args
from ar_torchrl.utils.files import exclusive

__all__ = [
    "build_sft_batch",
    "cached_warm_start",
    "column_response",
    "sft_response",
    "supervised_warm_start",
]

logger = logging.getLogger(__name__)
_FORMAT_VERSION = 1
_VOLATILE_CONFIG_KEYS = {"architectures", "_name_or_path", "transformers_version"}


def sft_response(ground_truth: str, correct: bool, rng: random.Random) -> str:
    """The supervised target: ``"Answer: X"``, with ``X`` the truth or a nearby wrong integer.

    Example:
        >>> rng = random.Random(0)
        >>> sft_response("12", True, rng), sft_response("12", False, rng)
        ('Answer: 12', 'Answer: 13')
    """
    try:
        truth = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(
            f"sft_response: the warm start needs integer ground truths, got {ground_truth!r}; "
            "use generated arithmetic rows (ar_torchrl.data) for the warm start."
        ) from None
    if correct:
        return f"Answer: {truth}"
    offset = rng.choice([d for d in range(-3, 4) if d != 0])
    return f"Answer: {truth + offset}"


def column_response(row: dict, column_accuracy: Sequence[float], rng: random.Random) -> str:
    """The supervised target of a ``data=critic_arithmetic`` row: its column-by-column trace
    (:func:`ar_torchrl.data.tasks.column_trace`), each column's sum right with probability
    ``column_accuracy[digits - 1]``, so the warm start's competence depends on the problem's size.

    Example:
        >>> from ar_torchrl.data.tasks import critic_arithmetic_rows
        >>> row = critic_arithmetic_rows([(57, 38)])[0]
        >>> column_response(row, [1.0, 1.0, 1.0], random.Random(0))
        '7+8=15\\n5+3+1=9\\nAnswer: 95'
    """
    from ar_torchrl.data.tasks import column_trace

    extra = row.get("extra_info") or {}
    try:
        a, plus, b = extra["problem"].split()
        digits = int(extra["digits"])
        if plus != "+":
            raise ValueError
        pair = (int(a), int(b))
    except (KeyError, ValueError, AttributeError):
        raise ValueError(
            "column traces need data=critic_arithmetic rows (extra_info.problem 'a + b' and "
            f"extra_info.digits), got extra_info={extra!r:.120}"
        ) from None
    if not 1 <= digits <= len(column_accuracy):
        raise ValueError(
            f"column_accuracy has {len(column_accuracy)} entries (one per operand digit count) "
            f"but row {extra.get('index')} ({extra['problem']}) has {digits} digits"
        )
    return column_trace(*pair, accuracy=column_accuracy[digits - 1], rng=rng)[0]


def _row_fields(row: dict, index: int) -> tuple[list[dict], str]:
    try:
        messages, truth = row["prompt"], row["reward_model"]["ground_truth"]
    except (KeyError, TypeError):
        raise ValueError(
            f"warm start row {index} is not in the DAPO-Math schema (needs 'prompt' messages and "
            f"'reward_model.ground_truth'); got keys {sorted(row) if isinstance(row, dict) else row!r}"
        ) from None
    return messages, str(truth)


def build_sft_batch(
    tokenizer, rows: Sequence[dict], responses: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize chat prompts + responses + EOS, right-padded; labels are ``-100`` off the response.

    Returns:
        ``input_ids`` ``[B, T]`` int64, ``attention_mask`` ``[B, T]`` int64, ``labels`` ``[B, T]``.

    Example:
        >>> from ar_torchrl.models.tiny import build_char_tokenizer
        >>> tok = build_char_tokenizer()
        >>> row = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}
        >>> ids, mask, labels = build_sft_batch(tok, [row], ["Answer: 2"])
        >>> tok.decode(ids[0][labels[0] != -100])
        'Answer: 2<|im_end|>'
    """
    seqs, targets = [], []
    for i, (row, response) in enumerate(zip(rows, responses, strict=True)):
        messages, _ = _row_fields(row, i)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        seqs.append(p_ids + r_ids)
        targets.append([-100] * len(p_ids) + r_ids)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, t) in enumerate(zip(seqs, targets)):
        ids[i, : len(s)], labels[i, : len(t)], mask[i, : len(s)] = (
            torch.tensor(s),
            torch.tensor(t),
            1,
        )
    return ids, mask, labels


def tool_trace(
    row: dict, tokenizer, *, call: bool, correct: bool, rng: random.Random
) -> tuple[list[int], list[int]]:
    """One supervised trace of the tool task (``data=tool_arithmetic`` rows) as ``(ids, labels)``.

    ``call``: the model asks the calculator (in the ``tag`` format), the tool's answer follows as the
    chat template's delta tokens (not trained), then the model answers with the tool's number; else
    it answers at once (correct with ``correct``, else a near miss: what a model that computes in
    its head writes). Trained tokens are labelled, every other one is ``-100``.

    Example:
        >>> from ar_torchrl.models.tiny import build_char_tokenizer
        >>> from ar_torchrl.data.tasks import tool_arithmetic_rows
        >>> tok = build_char_tokenizer()
        >>> ids, labels = tool_trace(tool_arithmetic_rows(1)[0], tok, call=True, correct=True,
        ...                          rng=random.Random(0))
        >>> tok.decode([i for i, l in zip(ids, labels) if l != -100])
        '<tool name="calculator">59*63</tool><|im_end|>Answer: 3717<|im_end|>'
    """
    from ar_torchrl.data.prompts import prompt_token_ids
    from ar_torchrl.tools.base import ToolCall
    from ar_torchrl.tools.parsers import TagParser
    from ar_torchrl.tools.template import tool_delta_ids

    messages, truth = _row_fields(row, 0)
    prompt = prompt_token_ids(messages, tokenizer)
    eos = [tokenizer.eos_token_id]

    def said(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] + eos

    segments: list[tuple[list[int], bool]] = [(prompt, False)]
    if call:
        a, _, b = row["extra_info"]["problem"].split()
        request = TagParser().format(ToolCall("calculator", f"{a}*{b}", ""))
        answer = tool_delta_ids(tokenizer, [{"role": "tool", "content": truth}])
        segments += [(said(request), True), (answer, False), (said(f"Answer: {truth}"), True)]
    else:
        segments.append((said(sft_response(truth, correct, rng)), True))
    ids = [t for seg, _ in segments for t in seg]
    labels = [t if trained else -100 for seg, trained in segments for t in seg]
    return ids, labels


def _tool_batch(tokenizer, rows, rng, tool_fraction: float, correct_fraction: float):
    traces = [
        tool_trace(
            r,
            tokenizer,
            call=rng.random() < tool_fraction,
            correct=rng.random() < correct_fraction,
            rng=rng,
        )
        for r in rows
    ]
    width = max(len(ids) for ids, _ in traces)
    ids = torch.full((len(traces), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(traces), width), -100, dtype=torch.long)
    mask = torch.zeros((len(traces), width), dtype=torch.long)
    for i, (s, t) in enumerate(traces):
        ids[i, : len(s)], labels[i, : len(t)], mask[i, : len(s)] = (
            torch.tensor(s),
            torch.tensor(t),
            1,
        )
    return ids, mask, labels


def supervised_warm_start(
    model: PreTrainedModel,
    tokenizer,
    rows: Sequence[dict],
    *,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 3e-3,
    final_lr_ratio: float = 0.1,
    correct_fraction: float = 0.3,
    grad_clip: float = 1.0,
    seed: int = 0,
    tool_fraction: float | None = None,
    column_accuracy: Sequence[float] | None = None,
) -> list[float]:
    """Train ``model`` in place on ``"Answer: X"`` responses (correct with prob ``correct_fraction``).

    With ``tool_fraction`` (tool-task rows), each row is a :func:`tool_trace` that calls the
    calculator with that probability (and answers directly otherwise): the call format is taught,
    the task is not solved (a model that never calls is right only ``correct_fraction`` of the time).
    With ``column_accuracy`` (``data=critic_arithmetic`` rows), each response is the row's
    column-by-column trace (:func:`column_response`; ``correct_fraction`` is not used).

    Each step samples ``batch_size`` rows (with replacement, seeded) and minimises the token-mean
    cross-entropy of the response and EOS. AdamW, learning rate decaying linearly from ``lr`` to
    ``lr * final_lr_ratio``, gradient norm clipped to ``grad_clip``.

    Returns:
        the per-step losses.

    Example:
        >>> from ar_torchrl.models import build_tiny_model
        >>> model, tok = build_tiny_model()
        >>> row = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}
        >>> losses = supervised_warm_start(model, tok, [row], steps=20, batch_size=2, correct_fraction=1.0)
        >>> losses[-1] < losses[0]
        True
    """
    check_warm_start_args(
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        final_lr_ratio=final_lr_ratio,
        correct_fraction=correct_fraction,
        grad_clip=grad_clip,
    )
    _check_warm_start_args(tokenizer, rows)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    decay = torch.optim.lr_scheduler.LinearLR(
        opt, 1.0, final_lr_ratio, total_iters=max(steps - 1, 1)
    )
    model.train()
    losses = []
    for _ in tqdm(range(steps), desc="warm start", leave=False):
        batch = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
        if column_accuracy is not None:
            responses = [column_response(r, column_accuracy, rng) for r in batch]
            ids, mask, labels = build_sft_batch(tokenizer, batch, responses)
        elif tool_fraction is None:
            responses = [
                sft_response(_row_fields(r, 0)[1], rng.random() < correct_fraction, rng)
                for r in batch
            ]
            ids, mask, labels = build_sft_batch(tokenizer, batch, responses)
        else:
            ids, mask, labels = _tool_batch(tokenizer, batch, rng, tool_fraction, correct_fraction)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        decay.step()
        losses.append(loss.item())
    model.eval()
    return losses


def _check_warm_start_args(tokenizer, rows) -> None:
    check_tokenizer(tokenizer, where="warm start tokenizer")
    if not rows:
        raise ValueError("supervised_warm_start: `rows` is empty; pass generated DAPO-schema rows.")


def _fingerprint(model: PreTrainedModel, tokenizer, rows: Sequence[dict], settings: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"v": _FORMAT_VERSION, "settings": settings}, sort_keys=True).encode())
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(str(tokenizer.chat_template).encode())
    h.update(json.dumps(list(rows), sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def cached_warm_start(
    model: PreTrainedModel,
    tokenizer,
    rows: Sequence[dict],
    *,
    cache_dir: str | os.PathLike,
    **settings,
) -> tuple[PreTrainedModel, Path]:
    """Warm-start ``model`` (see :func:`supervised_warm_start`) or load the cached result.

    Args:
        model: the initial model (its weights are part of the cache key; it is not modified).
        tokenizer: its tokenizer (saved with the result).
        rows: DAPO-schema rows with integer ground truths.
        cache_dir: where ``warmstart-<hash>/`` directories live.
        **settings: keyword arguments of :func:`supervised_warm_start`.

    Returns:
        the warm-started model (loaded from the cache directory, ``eval`` mode) and that directory.

    Example:
        >>> import tempfile
        >>> from ar_torchrl.models import build_tiny_model
        >>> model, tok = build_tiny_model()
        >>> row = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}
        >>> d = tempfile.mkdtemp()
        >>> _, path1 = cached_warm_start(model, tok, [row], cache_dir=d, steps=2, batch_size=2)
        >>> _, path2 = cached_warm_start(model, tok, [row], cache_dir=d, steps=2, batch_size=2)
        >>> path1 == path2, json.loads((path1 / "warmstart.json").read_text())["settings"]["steps"]
        (True, 2)
    """
    target = Path(cache_dir) / f"warmstart-{_fingerprint(model, tokenizer, rows, settings)}"
    # processes sharing the cache (parallel runs, test workers) train each warm start once
    with exclusive(_lock_path(target), what="the warm start"):
        _warm_start_once(model, tokenizer, rows, target, settings)
    started = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(target, dtype=model.dtype, local_files_only=True)
    logger.info("warm start: loaded in %.1f s", time.perf_counter() - started)
    return loaded.eval(), target


def _lock_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.lock")


def _warm_start_once(model, tokenizer, rows, target: Path, settings: dict) -> None:
    if (target / "warmstart.json").is_file():
        logger.info("warm start: loading cached %s", target)
    else:
        logger.info("warm start: supervised training, once (then cached in %s)", target)
        started = time.perf_counter()
        trained = _copy_model(model)
        losses = supervised_warm_start(trained, tokenizer, rows, **settings)
        _save_atomic(trained, tokenizer, target, {"settings": settings, "losses": losses})
        logger.info(
            "warm start: loss %.3f -> %.3f in %.1f s, saved %s",
            losses[0],
            losses[-1],
            time.perf_counter() - started,
            target,
        )


def _copy_model(model: PreTrainedModel) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):  # a cache miss must not advance the global RNG
        clone = type(model)(copy.deepcopy(model.config)).to(model.dtype)
    clone.load_state_dict(model.state_dict())
    return clone


def _save_atomic(model: PreTrainedModel, tokenizer, target: Path, info: dict) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "warmstart.json").write_text(json.dumps(info))  # written last: marks a complete dir
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first: keep theirs
            if not (target / "warmstart.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
