"""The value head: a zero-initialised float32 ``nn.Linear(hidden, 1)`` living inside the HF model.

It is registered as the submodule ``value_head`` of the causal LM, so ``model.state_dict()`` keys are
exactly the HF checkpoint keys plus ``value_head.weight`` / ``value_head.bias`` (docs/design.md section 3).
``model.save_pretrained`` writes a clean HF checkpoint (the head is listed in the instance's
``_keys_to_ignore_on_save``); :func:`save_value_head` writes the head to its own file beside it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

__all__ = [
    "VALUE_HEAD_FILE",
    "PopArtValueHead",
    "ValueHead",
    "ConfidenceFeatures",
    "attach_confidence_features",
    "attach_value_head",
    "load_value_head",
    "save_policy",
    "save_value_head",
]

logger = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.safetensors"
_HEAD_KEYS = ("value_head.weight", "value_head.bias")


class ValueHead(nn.Linear):
    """``nn.Linear(hidden_size, 1)`` in float32 with zero weight and bias (``V = 0`` at start).

    The input hidden state is cast to float32 first, so a bf16 backbone still gets an fp32 critic.

    Example:
        >>> head = ValueHead(8)
        >>> head(torch.randn(2, 3, 8)).shape, head(torch.randn(2, 8)).abs().sum().item()
        (torch.Size([2, 3, 1]), 0.0)
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden.to(self.weight.dtype))
        # nn.Linear on [B, L, H] returns a view of a [B*L, 1] matmul; FSDP2 warns on every call that
        # an in-place op on a view would skip its pre-backward hook. A [B, L, 1] copy avoids it.
        return out.clone() if out._is_view() else out


class PopArtValueHead(ValueHead):
    """A :class:`ValueHead` whose linear layer predicts *normalised* values (PopArt).

    ``forward`` returns ``V = sigma * (w . h + b) + mu`` (the value in return units: GAE and every
    metric see it), with ``mu``/``sigma`` running statistics of the value targets (buffers, saved
    with the model). :meth:`update_statistics` moves them with a batch of targets and rescales the
    layer so that every prediction is preserved (:mod:`ar_torchrl.functional.popart`);
    :meth:`normalize` maps values and targets to the layer's scale, where
    :class:`~ar_torchrl.objectives.TokenPPOLoss` computes the value loss.

    Args:
        hidden_size: the backbone's hidden size.
        beta: the statistics' step size per update (the first update takes the batch's moments).

    Example:
        >>> head = PopArtValueHead(4, beta=0.5)
        >>> with torch.no_grad():
        ...     _ = head.weight.fill_(0.5)
        >>> h = torch.ones(2, 4)
        >>> before = head(h)
        >>> head.update_statistics(torch.tensor([10.0, 30.0]))
        >>> round(head.mu.item(), 3), round(head.sigma.item(), 3), torch.allclose(head(h), before)
        (20.0, 10.0, True)
    """

    def __init__(self, hidden_size: int, *, beta: float = 0.1, eps: float = 1e-4) -> None:
        super().__init__(hidden_size)
        if not 0 < beta <= 1:
            raise ValueError(f"PopArtValueHead: beta must be in (0, 1], got {beta}")
        self.beta, self.eps = float(beta), float(eps)
        self.register_buffer("mu", torch.zeros((), dtype=torch.float64))
        self.register_buffer("nu", torch.ones((), dtype=torch.float64))
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    @property
    def sigma(self) -> torch.Tensor:
        from ar_torchrl.functional.popart import popart_sigma

        return popart_sigma(self.mu, self.nu, eps=self.eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normalised = super().forward(hidden)
        # sigma * n + mu in float64: mu and sigma can be far larger than V (cancellation)
        value = normalised.double() * self.sigma + self.mu
        return value.to(normalised.dtype)

    def normalize(self, value: torch.Tensor) -> torch.Tensor:
        """``(value - mu) / sigma`` in ``value``'s dtype (the layer's own output scale)."""
        return (value - self.mu.to(value.dtype)) / self.sigma.to(value.dtype)

    @torch.no_grad()
    def update_statistics(self, targets: torch.Tensor) -> None:
        """Move ``mu``/``sigma`` with ``targets`` (``[N]``, the trained tokens' value targets) and
        rescale the layer so that ``forward`` gives the same values as before."""
        from ar_torchrl.functional.popart import popart_scale_shift, popart_statistics

        mu, sigma = self.mu.clone(), self.sigma
        new_mu, new_nu = popart_statistics(
            self.mu, self.nu, targets.reshape(-1), beta=self.beta, first=int(self.updates) == 0
        )
        self.mu.copy_(new_mu)
        self.nu.copy_(new_nu)
        self.updates.add_(1)
        scale, shift = popart_scale_shift(mu, sigma, self.mu, self.sigma)
        self.weight.mul_(scale)  # floats: in place on plain and FSDP2-sharded parameters alike
        self.bias.mul_(scale).add_(shift)


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    if size is None and config is not None and hasattr(config, "get_text_config"):
        size = getattr(config.get_text_config(), "hidden_size", None)
    if size is None:
        raise ValueError(
            f"attach_value_head: cannot find `config.hidden_size` on {type(model).__name__}; "
            "pass an HF causal LM (e.g. Qwen3ForCausalLM)"
        )
    return int(size)


def attach_value_head(
    model: nn.Module, path: str | Path | None = None, *, popart_beta: float | None = None
) -> nn.Module:
    """Attach a zero-initialised :class:`ValueHead` as ``model.value_head`` (in place; returns model).

    Calling it on a model that already has a head keeps the existing head. With ``path`` (a
    directory holding ``value_head.safetensors``, or the file itself) the head weights are loaded.

    Args:
        model: an HF causal LM with ``config.hidden_size``.
        path: optional saved head to load.
        popart_beta: attach a :class:`PopArtValueHead` (normalised value targets) with this step
            size instead.

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> model = attach_value_head(build_tiny_qwen3(99))
        >>> [k for k in model.state_dict() if k.startswith("value_head")]
        ['value_head.weight', 'value_head.bias']
    """
    if not isinstance(getattr(model, "value_head", None), nn.Module):
        device = next(model.parameters()).device
        size = _hidden_size(model)
        head = ValueHead(size) if popart_beta is None else PopArtValueHead(size, beta=popart_beta)
        model.value_head = head.to(device)
    elif popart_beta is not None and not isinstance(model.value_head, PopArtValueHead):
        raise ValueError(
            "attach_value_head(popart_beta=...): the model already has a plain ValueHead; "
            "attach the PopArt head before training (its layer predicts normalised values)"
        )
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    head_keys = {f"value_head.{k}" for k in model.value_head.state_dict()}  # PopArt: + buffers
    model._keys_to_ignore_on_save = ignore | set(_HEAD_KEYS) | head_keys
    if path is not None:
        load_value_head(model, path)
    return model


class ConfidenceFeatures(nn.Module):
    """A small MLP of the policy's sampling log-probs so far, added to the value head's output.

    Registered as ``value_head.confidence`` (:func:`attach_confidence_features`), so its weights
    go wherever the head's go: the critic's param group and clip group, checkpoints, the head file
    of a critic export, never the rollout engine (``value_head.*``) nor a policy export. Its input is
    :func:`~ar_torchrl.functional.sampled_log_prob_features` of ``rollout_log_prob`` (the lowest,
    mean and last log-prob the policy gave a token it sampled before each token); its output layer
    starts at zero, so a critic with it starts with the same values as without. Measured on
    ``critic_arithmetic`` (docs/evidence.md): the critic then reads how its response is going
    instead of only how hard the prompt is.

    Example:
        >>> feats = ConfidenceFeatures()
        >>> lp, m = torch.tensor([[0.0, -0.1, -2.0]]), torch.tensor([[False, True, True]])
        >>> value, next_value = feats(lp, m)
        >>> value.shape, float(value.abs().sum() + next_value.abs().sum())  # zero output layer
        (torch.Size([1, 3, 1]), 0.0)
    """

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        from ar_torchrl.functional.confidence import CONFIDENCE_FEATURES

        if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
            raise ValueError(f"ConfidenceFeatures: hidden must be an int >= 1, got {hidden!r}")
        self.net = nn.Sequential(
            nn.Linear(len(CONFIDENCE_FEATURES), hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    @staticmethod
    def initial_state(hidden: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
        """The state of a fresh ``ConfidenceFeatures(hidden)`` drawn with ``torch.manual_seed(seed)``
        (the global RNG left as it was): the same on every rank and every run. A model built on
        the meta device starts from it (:func:`~ar_torchrl.distributed.load_pretrained_weights`).

        Example:
            >>> a, b = ConfidenceFeatures.initial_state(4), ConfidenceFeatures.initial_state(4)
            >>> all(torch.equal(a[k], b[k]) for k in a), float(a["net.2.weight"].abs().sum())
            (True, 0.0)
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return ConfidenceFeatures(hidden).state_dict()

    def forward(self, log_prob: torch.Tensor, loss_mask: torch.Tensor):
        """``(value_term, next_value_term)``, each ``[B, L, 1]`` fp32, 0 off ``loss_mask``: the
        additions to ``state_value`` (the state before each token) and ``("next",
        "state_value")`` (after it)."""
        from ar_torchrl.functional.confidence import sampled_log_prob_features

        before, through = sampled_log_prob_features(log_prob.float(), loss_mask)
        keep = loss_mask.unsqueeze(-1).to(torch.float32)
        return self.net(before) * keep, self.net(through) * keep


def attach_confidence_features(model: nn.Module, hidden: int = 32) -> nn.Module:
    """Attach a :class:`ConfidenceFeatures` as ``model.value_head.confidence`` (in place; returns
    model; an existing one is kept). ``LMActorCritic`` / ``LMCritic`` over the model then also
    read ``rollout_log_prob`` and ``loss_mask``.

    Raises:
        ValueError: the model has no value head, or a PopArt head (whose layer predicts normalised
            values; the two are not combined).

    Example:
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> model = attach_confidence_features(attach_value_head(build_tiny_qwen3(99)))
        >>> sorted(k for k in model.state_dict() if k.startswith("value_head"))[:3]
        ['value_head.bias', 'value_head.confidence.net.0.bias', 'value_head.confidence.net.0.weight']
    """
    head = getattr(model, "value_head", None)
    if not isinstance(head, nn.Module):
        raise ValueError(
            "attach_confidence_features: the model has no `value_head`; call attach_value_head "
            "first"
        )
    if isinstance(head, PopArtValueHead):
        raise ValueError(
            "attach_confidence_features: the value head is a PopArt head (normalised values); "
            "confidence features are added to unnormalised values, use a plain value head"
        )
    if not isinstance(getattr(head, "confidence", None), ConfidenceFeatures):
        head.confidence = ConfidenceFeatures(hidden).to(head.weight.device)
    return attach_value_head(model)  # refresh the keys save_pretrained leaves out


def confidence_of(model: nn.Module) -> ConfidenceFeatures | None:
    """``model.value_head.confidence`` when attached, else ``None``."""
    feats = getattr(getattr(model, "value_head", None), "confidence", None)
    return feats if isinstance(feats, ConfidenceFeatures) else None


def _head_file(path: str | Path) -> Path:
    path = Path(path)
    return path / VALUE_HEAD_FILE if path.is_dir() else path


def save_value_head(model: nn.Module, path: str | Path) -> Path:
    """Write ``model.value_head`` to ``path`` (a directory gets ``value_head.safetensors``)."""
    head = getattr(model, "value_head", None)
    if head is None:
        raise ValueError(
            "save_value_head: the model has no `value_head`; call attach_value_head first"
        )
    out = _head_file(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    state = {f"value_head.{k}": v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out))
    return out


def load_value_head(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a head saved by :func:`save_value_head` into ``model.value_head`` (attached if missing)."""
    file = _head_file(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"load_value_head: no value head at {file}; save one with save_value_head(model, dir)"
        )
    if getattr(model, "value_head", None) is None:
        attach_value_head(model)
    state = load_file(str(file))
    if any(k.startswith("value_head.confidence.") for k in state):
        hidden = state["value_head.confidence.net.0.weight"].shape[0]
        attach_confidence_features(model, hidden)
    missing = set(_HEAD_KEYS) - set(state)
    if missing:
        raise KeyError(f"load_value_head: {file} lacks {sorted(missing)}; it holds {sorted(state)}")
    device = model.value_head.weight.device
    model.value_head.load_state_dict(  # the layer in fp32; PopArt's statistics keep their dtype
        {
            k.removeprefix("value_head."): v.to(device, torch.float32)
            if k in _HEAD_KEYS
            else v.to(device)
            for k, v in state.items()
        }
    )
    return model


def save_policy(model: nn.Module, path: str | Path, tokenizer=None) -> Path:
    """``model.save_pretrained(path)`` (a clean HF checkpoint) plus the head file and tokenizer.

    Example:
        >>> import tempfile
        >>> from transformers import AutoModelForCausalLM
        >>> from ar_torchrl.models.tiny import build_tiny_qwen3
        >>> model = attach_value_head(build_tiny_qwen3(99))
        >>> _ = torch.nn.init.constant_(model.value_head.bias, 0.5)
        >>> d = save_policy(model, tempfile.mkdtemp())
        >>> again = attach_value_head(AutoModelForCausalLM.from_pretrained(d), d)
        >>> again.value_head.bias.item()
        0.5
    """
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    save_value_head(model, path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    logger.info("saved policy and value head to %s", path)
    return path
