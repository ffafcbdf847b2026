"""The registry of advantage estimators: name -> factory (verl's ``register_adv_est`` style).

A factory is called as ``factory(critic=..., **kwargs)`` and returns a module used as
``td = module(td)`` on a token-trajectory batch (it writes ``"advantage"``, and ``"value_target"``
when a value head is trained). ``critic`` says whether the policy has a trained value head (its
``state_value`` is in the batch): an estimator registered with ``needs_critic=True`` (GAE) refuses
to be built without one; the others receive the flag (GRPO then writes Monte-Carlo value targets so
that the head keeps training).

This module imports nothing heavy: the built-in factories import their class when called, so a
recipe can check ``algo.advantage_mode`` against :func:`advantage_names` before it imports torch.

Built-in: ``"gae"`` -> :class:`~ar_torchrl.objectives.TokenGAE`, ``"grpo"`` ->
:class:`~ar_torchrl.objectives.GRPOAdvantage`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["advantage_names", "make_advantage", "needs_critic", "register_advantage"]

Factory = TypeVar("Factory", bound=Callable[..., Any])


@dataclass(frozen=True)
class _Entry:
    factory: Callable[..., Any]
    needs_critic: bool


_REGISTRY: dict[str, _Entry] = {}


def register_advantage(name: str, *, needs_critic: bool = False) -> Callable[[Factory], Factory]:
    """Decorator: register ``factory(*, critic: bool, **kwargs)`` as the estimator ``name``.

    Args:
        name: the name configs use (``algo.advantage_mode`` in the recipe).
        needs_critic: the estimator reads ``state_value`` (a value head must be trained).

    Raises:
        ValueError: ``name`` is already registered to another factory.

    Example:
        >>> @register_advantage("reward_as_advantage")
        ... def _reward_as_advantage(*, critic: bool, scale: float = 1.0):
        ...     def module(td):
        ...         td["advantage"] = scale * td["next", "reward"] * td["loss_mask"].unsqueeze(-1)
        ...         return td
        ...     return module
        >>> "reward_as_advantage" in advantage_names()
        True
        >>> module = make_advantage("reward_as_advantage", scale=2.0)
    """

    def decorator(factory: Factory) -> Factory:
        old = _REGISTRY.get(name)
        if old is not None and old.factory is not factory:
            raise ValueError(
                f"register_advantage: {name!r} is already registered to {old.factory.__qualname__}"
            )
        _REGISTRY[name] = _Entry(factory, needs_critic)
        return factory

    return decorator


def advantage_names() -> tuple[str, ...]:
    """The registered estimator names, in registration order.

    Example:
        >>> advantage_names()[:2]
        ('gae', 'grpo')
    """
    return tuple(_REGISTRY)


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown advantage estimator {name!r}; registered: {list(_REGISTRY)} "
            "(add one with @ar_torchrl.objectives.register_advantage)"
        )
    return _REGISTRY[name]


def needs_critic(name: str) -> bool:
    """Whether estimator ``name`` reads the value head's ``state_value``.

    Example:
        >>> needs_critic("gae"), needs_critic("grpo")
        (True, False)
    """
    return _entry(name).needs_critic


def make_advantage(name: str, *, critic: bool = False, **kwargs: Any) -> Any:
    """Build the estimator registered as ``name`` with its keyword arguments.

    Args:
        name: a name of :func:`advantage_names`.
        critic: the policy has a trained value head (``state_value`` in the batch).
        **kwargs: the estimator's own arguments (e.g. ``gamma``, ``lmbda`` for GAE).

    Raises:
        ValueError: unknown name, or an estimator that needs a value head built without one.

    Example:
        >>> gae = make_advantage("gae", critic=True, gamma=1.0, lmbda=0.9)
        >>> type(gae).__name__, gae.lmbda
        ('TokenGAE', 0.9)
        >>> make_advantage("grpo", critic=True).critic_targets  # the head keeps training
        True
        >>> make_advantage("gae", critic=False)
        Traceback (most recent call last):
        ...
        ValueError: advantage estimator 'gae' needs a value head (critic=True): ...
    """
    entry = _entry(name)
    if entry.needs_critic and not critic:
        raise ValueError(
            f"advantage estimator {name!r} needs a value head (critic=True): it reads the "
            "'state_value' the head writes; train one, or use an estimator without a critic "
            f"({[n for n, e in _REGISTRY.items() if not e.needs_critic]})"
        )
    return entry.factory(critic=critic, **kwargs)


@register_advantage("gae", needs_critic=True)
def _token_gae(*, critic: bool, **kwargs: Any) -> Any:
    """Token-level GAE over the value head (:class:`~ar_torchrl.objectives.TokenGAE`)."""
    from ar_torchrl.objectives.gae import TokenGAE

    return TokenGAE(**kwargs)


@register_advantage("grpo")
def _grpo(*, critic: bool, **kwargs: Any) -> Any:
    """GRPO group z-scores (:class:`~ar_torchrl.objectives.GRPOAdvantage`).

    With a value head (``critic=True``) it also writes Monte-Carlo returns as ``value_target``
    (``critic_targets=True``), so swapping GAE for GRPO keeps the head training.
    """
    from ar_torchrl.objectives.grpo import GRPOAdvantage

    return GRPOAdvantage(critic_targets=critic, **kwargs)
