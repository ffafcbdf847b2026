"""Offline assets: a character-level tokenizer with a ChatML template and tiny Qwen3 models.

Nothing here downloads anything: the tokenizer is built with ``tokenizers`` and the model from a
``Qwen3Config``, so tests and the CPU recipe run on a machine with no network (docs/design.md section 5).
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

__all__ = ["CHATML_TEMPLATE", "build_char_tokenizer", "build_tiny_qwen3", "save_tiny_model"]

#: ChatML, as Qwen uses it; ``add_generation_prompt`` opens the assistant turn.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEFAULT_CHARS = "".join(chr(i) for i in range(32, 127)) + "\n"


def build_char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer with ChatML specials and a chat template.

    Ids: ``0 = <|endoftext|>`` (pad), ``1 = <|im_start|>``, ``2 = <|im_end|>`` (eos), then one id per
    character of ``chars`` in order. A BPE model without merges maps each character to its own id.

    Args:
        chars: the characters of the vocabulary (duplicates are an error).

    Example:
        >>> tok = build_char_tokenizer()
        >>> ids = tok("1 + 2")["input_ids"]
        >>> tok.decode(ids), tok.pad_token_id, tok.eos_token_id, len(tok)
        ('1 + 2', 0, 2, 99)
    """
    if len(set(chars)) != len(chars):
        raise ValueError(f"build_char_tokenizer: `chars` has duplicates: {chars!r}")
    unknown = set(chars) & set(string.whitespace) - {" ", "\n"}
    if unknown:
        raise ValueError(f"build_char_tokenizer: unsupported whitespace characters {unknown!r}")
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(chars))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_qwen3(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
    seed: int = 0,
) -> Qwen3ForCausalLM:
    """Build a randomly initialised float32 ``Qwen3ForCausalLM`` (``~100k`` params by default).

    Example:
        >>> model = build_tiny_qwen3(99)
        >>> sum(p.numel() for p in model.parameters()) < 200_000
        True
    """
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.float().eval()


def save_tiny_model(path: str | Path, *, seed: int = 0, **model_kwargs) -> Path:
    """Save a tiny Qwen3 and the char tokenizer as a HF directory loadable by HF and SGLang.

    Example:
        >>> import tempfile
        >>> d = save_tiny_model(tempfile.mkdtemp())
        >>> sorted(p.name for p in d.iterdir())[:2]
        ['chat_template.jinja', 'config.json']
    """
    path = Path(path)
    tok = build_char_tokenizer()
    model = build_tiny_qwen3(len(tok), seed=seed, **model_kwargs)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
