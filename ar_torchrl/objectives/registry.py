"""The registry of advantage estimators (:data:`ADVANTAGES`, verl's ``register_adv_est`` style).

An entry's factory is called as ``factory(options, *, critic, gamma)`` (``options``: an instance of
its torch-free config schema, range-checked) and returns a module used as ``td = module(td)`` on a
token-trajectory batch (it writes ``"advantage"``, and ``"value_target"`` when a value head is
trained). ``critic`` says whether the policy has a trained value head (its ``state_value`` is in the
batch): an estimator registered with ``needs_critic=True`` (GAE) refuses to be built without one;
the others receive the flag (GRPO then writes Monte-Carlo value targets so that the head keeps
training). A factory registered without a schema is called as ``factory(*, critic, **kwargs)``.

This module imports nothing heavy; the built-in estimators (``gae``, ``grpo``, ``rloo``) are
registered with their schemas in :mod:`ar_torchrl.objectives.config`, whose factories import their
class when called, so a recipe can list and check estimators before it imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ar_torchrl.registry import Registry

__all__ = [
    "ADVANTAGES",
    "advantage_names",
    "make_advantage",
    "needs_critic",
    "register_advantage",
]

Factory = TypeVar("Factory", bound=Callable[..., Any])

ADVANTAGES = Registry("advantage estimator", builtins=("ar_torchrl.objectives.config",))


def register_advantage(
    name: str, *, needs_critic: bool = False, config: type | None = None
) -> Callable[[Factory], Factory]:
    """Decorator: register an estimator factory as ``name``.

    Args:
        name: the name configs use (``algo.advantage_mode`` in the recipe).
        needs_critic: the estimator reads ``state_value`` (a value head must be trained).
        config: the dataclass of its options (``check(prefix)`` for ranges); the factory is then
            ``factory(options, *, critic, gamma)``, else ``factory(*, critic, **kwargs)``.

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
    return ADVANTAGES.register(name, config=config, needs_critic=needs_critic)


def advantage_names() -> tuple[str, ...]:
    """The registered estimator names, in registration order.

    Example:
        >>> advantage_names()[:3]
        ('gae', 'grpo', 'rloo')
    """
    return ADVANTAGES.names()


def needs_critic(name: str) -> bool:
    """Whether estimator ``name`` reads the value head's ``state_value``.

    Example:
        >>> needs_critic("gae"), needs_critic("grpo"), needs_critic("rloo")
        (True, False, False)
    """
    return ADVANTAGES[name].needs_critic


def make_advantage(
    name: str, *, critic: bool = False, gamma: float | None = None, **kwargs: Any
) -> Any:
    """Build the estimator registered as ``name`` with its options.

    Args:
        name: a name of :func:`advantage_names`.
        critic: the policy has a trained value head (``state_value`` in the batch).
        gamma: the discount (GAE's, and that of GRPO/RLOO's Monte-Carlo value targets); default
            1.0 (a factory without a schema gets it only when given).
        **kwargs: the estimator's own options (its schema's fields, e.g. ``lmbda`` for GAE).

    Raises:
        ValueError: unknown name or option, or an estimator that needs a value head built without.

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
    entry = ADVANTAGES[name]
    if entry.needs_critic and not critic:
        raise ValueError(
            f"advantage estimator {name!r} needs a value head (critic=True): it reads the "
            "'state_value' the head writes; train one, or use an estimator without a critic "
            f"({[e.name for e in ADVANTAGES.entries() if not e.needs_critic]})"
        )
    if entry.config is None:
        return entry.factory(critic=critic, **({} if gamma is None else {"gamma": gamma}), **kwargs)
    return ADVANTAGES.build(name, kwargs, critic=critic, gamma=1.0 if gamma is None else gamma)
