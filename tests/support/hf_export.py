"""Checks of an exported Hugging Face directory: the tensors it holds and the greedy tokens a model
generates (tests/models/test_export.py, tests/distributed/, tests/recipes/test_recipe_export.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

QUESTIONS = ("What is 3 + 4?", "What is 9 + 8?", "What is 1 + 6?", "What is 5 + 5?")


def weight_names(directory: Path, pattern: str = "model*.safetensors") -> set[str]:
    """Every tensor name in the directory's weight files (one file or the shards of an index)."""
    names: set[str] = set()
    for file in sorted(Path(directory).glob(pattern)):
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    return names


@torch.no_grad()
def greedy_tokens(model, prompts, max_new_tokens: int = 12) -> list[list[int]]:
    """The new token ids of ``model.generate`` (greedy) for each prompt (a list of ids), one prompt
    at a time (no padding)."""
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        gen = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
        out.append(gen[0, x.shape[1] :].tolist())
    return out


def chat_prompts(tokenizer, questions=QUESTIONS) -> list[list[int]]:
    """The chat-templated prompt ids of ``questions`` (the recipe's format)."""
    out = []
    for q in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out
