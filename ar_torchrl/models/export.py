"""Trained models as Hugging Face directories: the policy to serve, the critic to continue from.

- :func:`export_policy`: ``save_pretrained`` (safetensors) and the tokenizer, **no** ``value_head.*``
  tensor: ``AutoModelForCausalLM.from_pretrained(dir)`` loads it and any engine (SGLang, vLLM, TGI)
  serves it.
- :func:`export_critic`: a separate critic in the layout of
  :func:`~ar_torchrl.modules.save_policy`: its backbone as the same kind of HF directory, plus
  ``value_head.safetensors`` (``value_head.weight`` ``[1, hidden]`` and ``value_head.bias`` ``[1]``
  in float32; a PopArt head adds ``value_head.mu``, ``value_head.nu``, ``value_head.updates``, with
  its ``beta`` and ``eps`` in the file's metadata). :func:`load_critic` reads it back as an
  :class:`~ar_torchrl.modules.LMCritic`.

``tensors`` (optional): the ``(hf_name, tensor)`` pairs to write instead of the model's own
``state_dict`` (the model then gives the config and the class). A sharded model passes the full
tensors gathered on rank 0: :func:`ar_torchrl.distributed.export_trained` does. A directory is
written beside the target and renamed over it, so an interrupted export leaves the previous one.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ar_torchrl.modules import LMCritic, PopArtValueHead, attach_value_head, load_value_head
from ar_torchrl.modules.value_head import VALUE_HEAD_FILE
from ar_torchrl.weight_sync.names import VALUE_HEAD_PREFIX, is_policy_tensor, policy_only

__all__ = ["export_critic", "export_policy", "load_critic"]

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def export_policy(
    model: nn.Module, path: str | Path, tokenizer=None, *, tensors: NamedTensors | None = None
) -> Path:
    """Write ``model`` as a plain HF directory at ``path``: safetensors weights without any
    ``value_head.*`` tensor, the config, the generation config and (when given) the tokenizer.

    Args:
        model: an HF causal LM (a value head attached to it is left out).
        path: the directory to write (replaced if it exists).
        tokenizer: saved beside the weights (``tokenizer.save_pretrained``).
        tensors: the weights to write (default: ``model.state_dict()``), ``value_head.*`` dropped.

    Example:
        >>> import tempfile
        >>> from transformers import AutoModelForCausalLM
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> model = attach_value_head(build_tiny_qwen3(99))
        >>> d = export_policy(model, Path(tempfile.mkdtemp()) / "policy")
        >>> sorted(p.name for p in d.iterdir())
        ['config.json', 'generation_config.json', 'model.safetensors']
        >>> type(AutoModelForCausalLM.from_pretrained(d)).__name__
        'Qwen3ForCausalLM'
    """
    state = dict(policy_only(model.state_dict().items() if tensors is None else tensors))
    return _write(Path(path), model, state, tokenizer, head=None)


def export_critic(
    model: nn.Module | LMCritic,
    path: str | Path,
    tokenizer=None,
    *,
    tensors: NamedTensors | None = None,
) -> Path:
    """Write a separate critic at ``path``: its backbone as an HF directory (as
    :func:`export_policy`) and its value head as ``value_head.safetensors``.

    Args:
        model: the critic (:class:`~ar_torchrl.modules.LMCritic`, or its HF model with a value head).
        path: the directory to write (replaced if it exists).
        tokenizer: saved beside the weights (the policy's: the critic reads its token ids).
        tensors: every weight to write, ``value_head.*`` included (default: the model's own).

    Raises:
        ValueError: no ``value_head.*`` tensor to write (the model carries no value head).

    Example:
        >>> import tempfile
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> from ar_torchrl.modules import build_separate_critic
        >>> critic = build_separate_critic(build_tiny_qwen3(99))
        >>> _ = torch.nn.init.constant_(critic.model.value_head.bias, 0.25)
        >>> d = export_critic(critic, Path(tempfile.mkdtemp()) / "critic")
        >>> load_critic(d).model.value_head.bias.item()
        0.25
    """
    model = model.model if isinstance(model, LMCritic) else model
    pairs = list(model.state_dict().items() if tensors is None else tensors)
    head = {n: t for n, t in pairs if not is_policy_tensor(n)}
    if not head:
        raise ValueError(
            f"export_critic: no {VALUE_HEAD_PREFIX}* tensor among the {len(pairs)} given; the "
            "critic needs its value head (ar_torchrl.modules.attach_value_head)"
        )
    state = dict(policy_only(pairs))
    return _write(Path(path), model, state, tokenizer, head=(head, _head_metadata(model)))


def load_critic(path: str | Path, **from_pretrained_kwargs) -> LMCritic:
    """The critic :func:`export_critic` wrote: ``AutoModelForCausalLM.from_pretrained(path,
    **from_pretrained_kwargs)`` with its value head (a PopArt head when it was one).

    Raises:
        FileNotFoundError: ``path`` has no ``value_head.safetensors`` (a policy export has none).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    head_file = path / VALUE_HEAD_FILE
    if not head_file.is_file():
        raise FileNotFoundError(
            f"load_critic: no {VALUE_HEAD_FILE} in {path}; a critic export (run_dir/critic/) has "
            "one, a policy export (run_dir/policy/) does not"
        )
    with safe_open(str(head_file), framework="pt") as f:
        meta = f.metadata() or {}
    model = AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)
    if meta.get("head") == "popart":
        attach_value_head(model, popart_beta=float(meta["beta"]))
        model.value_head.eps = float(meta["eps"])
    return LMCritic(load_value_head(model, head_file))


def _head_metadata(model: nn.Module) -> dict[str, str]:
    head = model.value_head
    if isinstance(head, PopArtValueHead):
        return {"head": "popart", "beta": repr(head.beta), "eps": repr(head.eps)}
    return {"head": "linear"}


def _tie_aliases(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied parameters (one module parameter under several names, e.g. ``lm_head.weight`` and
    ``model.embed_tokens.weight``) as one tensor: gathered copies are separate tensors, and
    ``save_pretrained`` writes an alias once only when it is the same storage."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name and owner in state and name in state:
            state[name] = state[owner]
    return state


def _write(path: Path, model, state, tokenizer, *, head) -> Path:
    tmp = path.with_name(f"{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=_tie_aliases(model, state))
    if head is not None:
        tensors, metadata = head
        cpu = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
        save_file(cpu, str(tmp / VALUE_HEAD_FILE), metadata=metadata)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    logger.debug("exported %s to %s", "the critic" if head else "the policy", path)
    return path
