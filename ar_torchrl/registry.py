"""Registries of named components, each entry carrying its torch-free config schema.

One :class:`Registry` per kind of component (advantage estimators, weight-sync methods, tasks,
rewards, models, rollout backends). An entry is

- a **factory** that builds the component (``factory(options, **context)``), importing the heavy
  implementation when called;
- a **config schema**: a dataclass whose fields are the component's configurable keys (types and
  defaults), with an optional ``check(prefix)`` method that applies the range checks of
  :mod:`ar_torchrl.utils.checks` (the checks the component itself applies);
- free-form metadata (``needs_critic``, ``engine``, ``help``, ...).

Nothing here imports torch, so a recipe can list the options and validate a whole configuration
before it loads the training stack; the recipe stores the schemas in Hydra's ConfigStore and builds
components *by lookup* (:meth:`Registry.build`), never by ``isinstance`` chains. Built-in entries
are registered by torch-free modules that a registry imports on first lookup (``builtins``).

Example:
    >>> from dataclasses import dataclass
    >>> from ar_torchrl.utils.checks import check_number
    >>> shapes = Registry("shape")
    >>> @dataclass
    ... class SquareConfig:
    ...     side: float = 1.0
    ...     def check(self, prefix: str) -> None:
    ...         check_number(prefix, "side", self.side, gt=0)
    >>> @shapes.register("square", config=SquareConfig, help="a square")
    ... def _square(options: SquareConfig) -> float:
    ...     return options.side**2
    >>> shapes.names(), shapes.build("square", {"side": 3.0})
    (('square',), 9.0)
    >>> shapes.options("square", {"side": -1.0}, prefix="config: shape.")
    Traceback (most recent call last):
    ...
    ValueError: config: shape.side must be > 0, got -1.0
    >>> shapes.options("square", {"sied": 2.0})
    Traceback (most recent call last):
    ...
    ValueError: shape 'square' has no option 'sied' (did you mean 'side'?); its options: ['side']
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["Entry", "Registry", "closest"]

F = TypeVar("F", bound=Callable[..., Any])


def closest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to ``name``, or ``""``.

    Example:
        >>> closest("lrr", ["lr", "value_lr", "gamma"])
        " (did you mean 'lr'?)"
    """
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


@dataclass(frozen=True)
class Entry:
    """A registered component: ``factory(options, **context)``, its schema, its metadata."""

    name: str
    factory: Callable[..., Any]
    config: type | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __getattr__(self, key: str) -> Any:  # entry.needs_critic, entry.engine, ...
        meta = object.__getattribute__(self, "meta")
        if key in meta:
            return meta[key]
        raise AttributeError(f"{type(self).__name__} {self.name!r} has no {key!r}")


class Registry:
    """Name -> :class:`Entry` for one kind of component.

    Args:
        kind: what the entries are, used in messages (``"advantage estimator"``).
        builtins: torch-free modules that register the built-in entries, imported on first use.
    """

    def __init__(self, kind: str, *, builtins: Iterable[str] = ()) -> None:
        self.kind = kind
        self._builtins = tuple(builtins)
        self._loaded = not self._builtins
        self._entries: dict[str, Entry] = {}

    # ------------------------------------------------------------------ registering
    def register(self, name: str, *, config: type | None = None, **meta: Any) -> Callable[[F], F]:
        """Decorator: register ``factory`` as ``name`` with its config schema and metadata.

        Raises:
            ValueError: ``name`` is already registered to another factory, or ``config`` is not a
                dataclass.
        """
        if config is not None and not dataclasses.is_dataclass(config):
            raise ValueError(f"{self.kind} {name!r}: config must be a dataclass, got {config!r}")

        def decorator(factory: F) -> F:
            old = self._entries.get(name)
            if old is not None and old.factory is not factory:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered to {old.factory.__qualname__}"
                )
            self._entries[name] = Entry(name, factory, config, dict(meta))
            return factory

        return decorator

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self._builtins:
                importlib.import_module(module)

    # ------------------------------------------------------------------ looking up
    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order."""
        self._load()
        return tuple(self._entries)

    def entries(self) -> tuple[Entry, ...]:
        self._load()
        return tuple(self._entries.values())

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __getitem__(self, name: str) -> Entry:
        self._load()
        if name not in self._entries:
            raise ValueError(
                f"unknown {self.kind} {name!r}{closest(str(name), self._entries)}; registered: "
                f"{list(self._entries)}"
            )
        return self._entries[name]

    def entry_for(self, options: Any) -> Entry:
        """The entry whose schema ``options`` is an instance of (the most derived one)."""
        self._load()
        found = [e for e in self._entries.values() if e.config and isinstance(options, e.config)]
        if not found:
            raise TypeError(
                f"no {self.kind} has the config schema {type(options).__name__}; registered "
                f"schemas: {[e.config.__name__ for e in self._entries.values() if e.config]}"
            )
        return max(found, key=lambda e: len(e.config.__mro__))

    # ------------------------------------------------------------------ options and building
    def options(self, name: str, values: Any = None, *, prefix: str = "") -> Any:
        """``name``'s schema filled from ``values`` (a mapping, an instance, or ``None`` for the
        defaults) and range-checked; ``prefix`` is how messages name the keys (``"config: algo."``).

        Raises:
            ValueError: an unknown option (naming the closest known one) or a value out of range.
        """
        schema = self[name].config
        if schema is None:
            if values:
                raise ValueError(f"{self.kind} {name!r} takes no options, got {dict(values)}")
            return None
        if isinstance(values, schema):
            options = values
        else:
            values = dict(values or {})
            fields = [f.name for f in dataclasses.fields(schema)]
            for key in values:
                if key not in fields:
                    where = f"{prefix}{key}: " if prefix else ""
                    raise ValueError(
                        f"{where}{self.kind} {name!r} has no option {key!r}{closest(key, fields)}; "
                        f"its options: {fields}"
                    )
            options = schema(**values)
        check = getattr(options, "check", None)
        if check is not None:
            check(prefix)
        return options

    def build(self, name: str, options: Any = None, /, **context: Any) -> Any:
        """Build ``name`` from its (checked) options; ``context`` goes to the factory as is."""
        entry = self[name]
        if entry.config is None:
            return entry.factory(**context)
        return entry.factory(self.options(name, options), **context)
