"""The registry of advantage estimators (:data:`ADVANTAGES`, verl's ``register_adv_est`` style).

An estimator is registered by decorating its options' dataclass (the one shape of
:mod:`ar_torchrl.registry`)::

    @register_advantage("rloo", help="leave-one-out baseline over the prompt's group")
    @dataclass
    class RLOOConfig:
        def build(self, *, critic: bool, gamma: float) -> Any: ...

``build`` returns a module used as ``td = module(td)`` on a token-trajectory batch (it writes
``"advantage"``, and ``"value_target"`` when a value head is trained). ``critic`` says whether the
policy has a trained value head (its ``state_value`` is in the batch): an estimator registered with
``needs_critic=True`` (GAE) refuses to be built without one; the others receive the flag (GRPO then
writes Monte-Carlo value targets so that the head keeps training). ``gamma`` is the recipe's shared
``algo.gamma``; the schema's fields are the ``algo.<name>.*`` keys.

This module imports nothing heavy; the built-in estimators (``gae``, ``grpo``, ``rloo``,
``reinforce_pp``) are registered in :mod:`ar_torchrl.objectives.config`, whose ``build`` methods
import their class when called, so a recipe can list and check estimators before it imports torch.
"""

from __future__ import annotations

from typing import Any

from ar_torchrl.registry import Registry

__all__ = [
    "ADVANTAGES",
    "advantage_names",
    "make_advantage",
    "needs_critic",
    "register_advantage",
]

ADVANTAGES = Registry(
    "advantage estimator",
    builtins=("ar_torchrl.objectives.config",),
    decorator="register_advantage",
    build="build(self, *, critic: bool, gamma: float)",
    meta={"needs_critic": False},
)

#: ``@register_advantage(name, help=..., needs_critic=False)`` on the estimator's options dataclass
#: (:meth:`ar_torchrl.registry.Registry.register` of :data:`ADVANTAGES`).
register_advantage = ADVANTAGES.register


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
    if entry.config is None:  # an old-shape factory without a schema (deprecated)
        return entry.factory(critic=critic, **({} if gamma is None else {"gamma": gamma}), **kwargs)
    return ADVANTAGES.build(name, kwargs, critic=critic, gamma=1.0 if gamma is None else gamma)
