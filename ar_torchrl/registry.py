"""Registries of named components: one decorator shape for all of them.

One :class:`Registry` per kind of component (advantage estimators, policy losses, weight-sync
methods, tasks, rewards, tools, tool-call parsers, models, rollout backends, environment kinds).
Every entry is registered the same way, by decorating its **schema**::

    @ADVANTAGES.register("rloo", help="leave-one-out baseline", needs_critic=False)
    @dataclass
    class RLOOConfig:
        def check(self, prefix: str) -> None: ...    # optional: the options' range checks
        def build(self, *, critic: bool, gamma: float): ...   # makes the component

- the schema is a dataclass whose fields are the component's options (OmegaConf-compatible
  annotations: a recipe stores it in Hydra's ConfigStore); ``check(prefix)`` (optional) range-checks
  them with the functions of :mod:`ar_torchrl.utils.checks` that the component itself calls;
  ``build(self, **context)`` makes the component (what ``context`` holds is each registry's
  contract, stated in its module: ``critic``/``gamma`` for estimators, a ``BackendContext`` for
  backends, nothing for tasks...);
- ``help`` says in one line what it is; any other keyword is metadata (``needs_critic``,
  ``engine``), read as ``entry.needs_critic``.

Each ``register_<kind>`` function of the library *is* its registry's :meth:`Registry.register`.

**Where schemas live.** A schema is registered by the module that holds the component's code when
that module imports nothing heavy (tasks, rewards, tools, parsers: one file). A built-in whose code
needs torch (estimators, policy losses, models, backends, senders, environments) registers from its
package's torch-free ``config`` module (``objectives/config.py``, ``backends/<engine>/config.py``...)
and ``build`` imports the code, so that a recipe lists and validates every option before it imports
torch. A component of your own is one file (schema, registration and code; torch allowed) that the
recipe imports through its ``imports:`` list or a ``_component_`` path (``docs/extending.md``).

Built-in entries are registered by the modules a registry imports on first lookup (``builtins``).

Example:
    >>> from dataclasses import dataclass
    >>> from ar_torchrl.utils.checks import check_number
    >>> shapes = Registry("shape")
    >>> @shapes.register("square", help="a square")
    ... @dataclass
    ... class Square:
    ...     side: float = 1.0
    ...     def check(self, prefix: str) -> None:
    ...         check_number(prefix, "side", self.side, gt=0)
    ...     def build(self, *, scale: float = 1.0) -> float:
    ...         return scale * self.side**2
    >>> shapes.names(), shapes.build("square", {"side": 3.0}, scale=2.0)
    (('square',), 18.0)
    >>> shapes["square"].help
    'a square'
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
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["Entry", "Registry", "closest", "registries", "resolve_component"]

T = TypeVar("T")

_REGISTRIES: list[Registry] = []


def closest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to ``name``, or ``""``: the longest
    known name that ``name`` starts with (``lr_typo`` -> ``lr``), else the most similar one.

    Example:
        >>> closest("lrr", ["lr", "value_lr", "gamma"]), closest("lr_typo", ["grpo", "lr"])
        (" (did you mean 'lr'?)", " (did you mean 'lr'?)")
    """
    known = list(known)
    prefixes = [k for k in known if len(k) >= 2 and name.startswith(k)]
    match = [max(prefixes, key=len)] if prefixes else []
    match = match or difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def registries() -> tuple[Registry, ...]:
    """Every :class:`Registry` created so far (the library's, and any of a user's), in order."""
    return tuple(_REGISTRIES)


@dataclass(frozen=True)
class Entry:
    """A registered component: its schema, its metadata (``help`` and the rest).

    ``factory`` is set only for an entry registered in the old shape (a factory function, deprecated:
    ``factory(options, **context)``, or ``factory(**context)`` without a schema).
    """

    name: str
    factory: Callable[..., Any] | None
    config: type | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __getattr__(self, key: str) -> Any:  # entry.needs_critic, entry.engine, entry.help, ...
        meta = object.__getattribute__(self, "meta")
        if key in meta:
            return meta[key]
        raise AttributeError(f"{type(self).__name__} {self.name!r} has no {key!r}")

    @property
    def schema(self) -> type | None:
        """The options' dataclass (``None`` only for an old-shape factory without one)."""
        return self.config

    def build(self, options: Any, **context: Any) -> Any:
        """The component: ``options.build(**context)`` (``options``: an instance of the schema)."""
        if self.factory is None:
            return options.build(**context)
        if self.config is None:
            return self.factory(**context)
        return self.factory(options, **context)


class Registry:
    """Name -> :class:`Entry` for one kind of component.

    Args:
        kind: what the entries are, used in messages (``"advantage estimator"``).
        builtins: modules that register the built-in entries, imported on first use.
        decorator: how users spell :meth:`register` (``"register_advantage"``), for messages.
        build: the signature of the schemas' ``build`` (``"build(self, *, critic, gamma)"``), for
            messages.
        meta: default metadata of every entry (``{"needs_critic": False}``).
        required: metadata every entry must give (``("engine",)``).
        base: a class every schema must subclass (what the caller asks of every entry beyond
            ``build``, e.g. :class:`~ar_torchrl.backends.registry.BackendConfig`).
    """

    def __init__(
        self,
        kind: str,
        *,
        builtins: Iterable[str] = (),
        decorator: str | None = None,
        build: str = "build(self, **context)",
        meta: Mapping[str, Any] | None = None,
        required: Iterable[str] = (),
        base: type | None = None,
    ) -> None:
        self.kind = kind
        self.decorator = decorator or "register"
        self.build_signature = build
        self._defaults = dict(meta or {})
        self._required = tuple(required)
        self.base = base
        self._builtins = tuple(builtins)
        self._loaded = not self._builtins
        self._entries: dict[str, Entry] = {}
        _REGISTRIES.append(self)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"

    # ------------------------------------------------------------------ registering
    def register(
        self, name: str, *, help: str = "", config: type | None = None, **meta: Any
    ) -> Callable[[T], T]:
        """Class decorator: register the dataclass ``schema`` (options, optional ``check(prefix)``,
        ``build(self, **context)``) as ``name``, with its one-line ``help`` and metadata.

        The old shape (decorating a factory function, with its schema as ``config=``) still works
        for one release, with a ``DeprecationWarning``.

        Raises:
            ValueError: ``name`` is already registered to another schema, the schema is not a
                dataclass with a ``build`` method, or required metadata is missing.
        """
        missing = [key for key in self._required if key not in meta]
        if missing:
            raise ValueError(f"{self.kind} {name!r}: give {missing} when registering it")
        if config is not None and not dataclasses.is_dataclass(config):
            raise ValueError(f"{self.kind} {name!r}: config must be a dataclass, got {config!r}")
        meta = {**self._defaults, "help": help, **meta}

        def decorator(target: T) -> T:
            if isinstance(target, type):
                if config is not None:
                    raise ValueError(
                        f"{self.kind} {name!r}: decorate the schema itself, without config="
                    )
                self._check_schema(name, target)
                entry = Entry(name, None, target, meta)
            else:
                self._warn_old_shape(name, meta)
                entry = Entry(name, target, config, meta)
            self._add(entry)
            return target

        return decorator

    def _check_schema(self, name: str, schema: type) -> None:
        if not dataclasses.is_dataclass(schema) or not callable(getattr(schema, "build", None)):
            raise ValueError(
                f"{self.kind} {name!r}: register a @dataclass whose {self.build_signature} makes "
                f"the component, got {schema!r}"
            )
        if self.base is not None and not issubclass(schema, self.base):
            raise ValueError(
                f"{self.kind} {name!r}: its schema {schema.__name__} must subclass "
                f"{self.base.__module__}.{self.base.__qualname__}"
            )

    def _warn_old_shape(self, name: str, meta: Mapping[str, Any]) -> None:
        extra = "".join(
            f", {k}={v!r}" for k, v in meta.items() if k != "help" and v != self._defaults.get(k)
        )
        warnings.warn(
            f"registering a factory function as {self.kind} {name!r} is deprecated (removed in "
            f"ar_torchrl 0.2): decorate its options dataclass instead, @{self.decorator}({name!r}"
            f"{extra}) on a @dataclass whose {self.build_signature} makes the component",
            DeprecationWarning,
            stacklevel=3,
        )

    def _add(self, entry: Entry) -> None:
        old = self._entries.get(entry.name)
        if old is not None and _origin(old) != _origin(entry):
            raise ValueError(
                f"{self.kind} {entry.name!r} is already registered to {_origin(old)[1]}"
            )
        self._entries[entry.name] = entry

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self._builtins:
                importlib.import_module(module)
            # built-ins first, in the order of `builtins`, whichever module was imported first
            order = {m: i for i, m in enumerate(self._builtins)}
            ranked = sorted(
                self._entries.values(), key=lambda e: order.get(_origin(e)[0], len(order))
            )  # stable: registration order within a module
            self._entries = {e.name: e for e in ranked}

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

    def lookup(self, name: Any, *, key: str = "") -> Entry:
        """``self[name]``; an unknown name's error starts with ``key`` (``"config: tools.tools"``).

        Example:
            >>> from ar_torchrl.tools.registry import TOOLS
            >>> TOOLS.lookup("calculater", key="config: tools.tools")
            Traceback (most recent call last):
            ...
            ValueError: config: tools.tools: unknown tool 'calculater' (did you mean 'calculator'?); registered: ['calculator']
        """
        try:
            return self[name]
        except ValueError as err:
            if not key:
                raise
            raise ValueError(f"{key}: {err}") from None

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
        """Build ``name`` from its (checked) options; ``context`` goes to ``build`` as is."""
        return self[name].build(self.options(name, options), **context)


def _origin(entry: Entry) -> tuple[Any, ...]:
    """What an entry was registered from: the same schema class registered again (its module
    imported a second time) replaces the entry; another one is an error. A factory (the old shape)
    is itself."""
    if entry.factory is not None:
        return (entry.factory.__module__, entry.factory.__qualname__, id(entry.factory))
    return (entry.config.__module__, entry.config.__qualname__)


def resolve_component(path: str, registry: Registry) -> tuple[str, type]:
    """``(name, schema)`` of the entry of ``registry`` whose schema is the class at the dotted
    ``path`` (torchtune's ``_component_``): the class's module is imported first, so that its own
    registration runs.

    Raises:
        ValueError: the path does not import, or names a class that ``registry`` does not hold.

    Example:
        >>> from ar_torchrl.data.registry import TASKS
        >>> resolve_component("ar_torchrl.data.datasets.ArithmeticDataConfig", TASKS)[0]
        'arithmetic'
        >>> resolve_component("ar_torchrl.data.datasets.MathDataset", TASKS)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: _component_: ar_torchrl.data.datasets.MathDataset is not a registered task schema; register it with @register_task(...) (registered: [...])
    """
    module, _, attr = str(path).rpartition(".")
    try:
        target = getattr(importlib.import_module(module), attr) if module else None
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"_component_: cannot import {path!r} ({type(err).__name__}: {err}); give the dotted "
            "path of a registered schema class (my_pkg.module.MyConfig) on the PYTHONPATH"
        ) from None
    for entry in registry.entries():
        if entry.config is not None and entry.config is target:
            return entry.name, target
    raise ValueError(
        f"_component_: {path} is not a registered {registry.kind} schema; register it with "
        f"@{registry.decorator}(...) (registered: {list(registry.names())})"
    )
