"""Typed recipe configurations: schemas from the registries, validation, and ``--help``.

A recipe's configuration is a tree of dataclasses: its own sections plus, for each config group
(``model``, ``backend``, ``data``, ``reward``), the schemas the component registries carry
(:mod:`ar_torchrl.registry`). :func:`group_schemas` lists them as ``(group, "schema_<name>",
schema)`` for Hydra's ConfigStore (the entry point stores them; YAML options name theirs in
``defaults``), so Hydra rejects a wrong type or an unknown key while composing. :func:`validate`
then builds the typed object, rejects keys that no schema reads (added with ``+key=value``, which
Hydra allows), and runs every section's range checks. Nothing here imports torch or Hydra.

Components from outside the library: a config's ``imports:`` list names modules that register
components (:func:`component_imports` reads it before Hydra composes, :func:`import_components`
imports them), and a group option may name its schema class by dotted path instead of a
``defaults`` entry (torchtune's ``_component_``: ``_component_: my_pkg.tasks.MyTaskConfig``).
:func:`check_overrides` answers a typo'd ``key=value`` with the closest known key before Hydra
does.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ar_torchrl.registry import Registry, closest, resolve_component

#: The shipped Hydra configurations (``ar_torchrl/configs/``: package data, in the wheel too).
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"

__all__ = [
    "CONFIG_DIR",
    "check_overrides",
    "component_imports",
    "group_schemas",
    "import_components",
    "render_help",
    "unknown_keys",
    "validate",
]


def group_schemas(groups: Mapping[str, Registry]) -> Iterator[tuple[str, str, type]]:
    """``(group, "schema_<name>", schema)`` for every registered entry with a schema."""
    for group, registry in groups.items():
        for entry in registry.entries():
            if entry.config is not None:
                yield group, f"schema_{entry.name}", entry.config


def unknown_keys(raw: Any, typed: Any, prefix: str = "") -> list[str]:
    """Dotted keys of ``raw`` (a config tree) that the typed dataclass tree ``typed`` has no field
    for, each with the closest known key (``"algo.lrr (did you mean 'algo.lr'?)"``). Free-form
    ``dict`` fields are the business of their own schema and are not entered.

    Example:
        >>> @dataclasses.dataclass
        ... class Algo:
        ...     lr: float = 1e-3
        >>> unknown_keys({"lr": 1e-3, "lrr": 1e-4}, Algo(), "algo.")
        ["algo.lrr (did you mean 'algo.lr'?)"]
    """
    if not dataclasses.is_dataclass(typed) or not isinstance(raw, (Mapping, DictConfig)):
        return []
    fields = {f.name for f in dataclasses.fields(typed)}
    found = []
    for key in raw:
        if key not in fields:
            hint = closest(str(key), fields).replace("'", f"'{prefix}", 1)
            found.append(f"{prefix}{key}{hint}")
        else:
            found += unknown_keys(raw[key], getattr(typed, key), f"{prefix}{key}.")
    return found


def validate(
    raw: DictConfig,
    schema: type,
    *,
    groups: Mapping[str, Registry] | None = None,
    prefix: str = "config: ",
) -> Any:
    """The typed, checked configuration (interpolations resolved): the modules of ``imports`` are
    imported first and every group option of ``groups`` given as ``_component_`` gets its schema.

    Raises:
        ValueError, TypeError: a value out of range, of the wrong type, missing, or a key that no
            schema reads, naming the key; a module of ``imports`` or a ``_component_`` path that
            does not import.
    """
    import_components(raw.get("imports") or [])
    resolve_components(raw, groups or {})
    try:
        typed = OmegaConf.to_object(raw)
    except OmegaConfBaseException as err:  # a missing value, an unresolvable ${...}
        raise ValueError(f"config: {err}") from None
    if not isinstance(typed, schema):
        raise TypeError(
            f"config: expected the recipe's schema, got {type(typed).__name__}: the primary "
            "config must list `schema` first in its defaults"
        )
    unknown = unknown_keys(OmegaConf.to_container(raw, resolve=False), typed)
    if unknown:
        raise ValueError(
            f"config: no schema has the key(s) {', '.join(unknown)}: a `+key=value` override adds a "
            "key that nothing reads; fix the name (`python <recipe> --help` lists every key)"
        )
    typed.check()
    return typed


# --------------------------------------------------------------------------- outside components
def import_components(modules: Iterable[str]) -> None:
    """Import the modules of a config's ``imports:`` list (each registers its components with the
    library's decorators, so that their names can be chosen).

    Raises:
        ValueError: a module that does not import, naming it and the error.

    Example:
        >>> import_components(["ar_torchrl.data.tasks"])
        >>> import_components(["my_pkg.nope"])
        Traceback (most recent call last):
        ...
        ValueError: config: imports: cannot import 'my_pkg.nope' (ModuleNotFoundError: No module named 'my_pkg'); put its package on the PYTHONPATH
    """
    if isinstance(modules, str):
        modules = [modules]
    for module in modules:
        try:
            importlib.import_module(str(module))
        except ImportError as err:
            raise ValueError(
                f"config: imports: cannot import {module!r} ({type(err).__name__}: {err}); put its "
                "package on the PYTHONPATH"
            ) from None


def resolve_components(raw: DictConfig, groups: Mapping[str, Registry]) -> None:
    """Give every group option written as ``{_component_: pkg.module.Schema, key: value, ...}``
    its registered schema (the class's module is imported, which registers it), in place."""
    for group, registry in groups.items():
        node = raw.get(group)
        if not isinstance(node, DictConfig) or "_component_" not in node:
            continue
        values = OmegaConf.to_container(node, resolve=False)
        path = values.pop("_component_")
        try:
            _, schema = resolve_component(path, registry)
        except ValueError as err:
            raise ValueError(f"config: {group}.{err}") from None
        try:
            typed = OmegaConf.merge(OmegaConf.structured(schema), values)
        except OmegaConfBaseException as err:
            raise ValueError(f"config: {group} ({path}): {err}") from None
        with open_dict(raw):
            raw[group] = typed


def component_imports(
    config_dirs: Iterable[Path], config_name: str, argv: Iterable[str]
) -> list[str]:
    """The ``imports:`` of a launch before Hydra composes it: those of the primary config
    ``config_name`` (and of the primary configs its ``defaults`` start from), then an
    ``imports=[...]`` override.

    Example:
        >>> component_imports([], "none", ["imports=[my_pkg.tasks, my_pkg.losses]"])
        ['my_pkg.tasks', 'my_pkg.losses']
    """
    found: list[str] = []
    for node in _primary_chain([Path(d) for d in config_dirs], config_name):
        found += _names(node.get("imports"))
    for arg in argv:
        key, eq, value = str(arg).lstrip("+").partition("=")
        if eq and key == "imports":
            found += _names(yaml.safe_load(value) if value.strip() else None)
    return list(dict.fromkeys(found))


def _names(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value or []]


def _primary_chain(dirs: list[Path], name: str, seen: set[str] | None = None) -> list[dict]:
    """The YAML of primary config ``name`` (the first file found in ``dirs``), after those of the
    primary configs its ``defaults`` list starts from (``- dapo_ppo``): Hydra's merge order."""
    seen = set() if seen is None else seen
    path = next((d / f"{name}.yaml" for d in dirs if (d / f"{name}.yaml").is_file()), None)
    if path is None or name in seen:
        return []
    seen.add(name)
    node = yaml.safe_load(path.read_text()) or {}
    chain = []
    for item in node.get("defaults") or []:
        if isinstance(item, str) and item not in ("_self_", "schema"):
            chain += _primary_chain(dirs, item, seen)
    return [*chain, node]


# --------------------------------------------------------------------------- typo'd keys
def check_overrides(
    schema: type,
    groups: Mapping[str, Registry],
    config_dirs: Iterable[Path],
    config_name: str,
    argv: Iterable[str],
) -> None:
    """Every ``key=value`` override must name a key of the configuration: a typo gets the closest
    known key here, before Hydra (whose own answer suggests adding the key with ``+``). Group
    options are looked up in the option the launch picks (its YAML's schema); ``+key``, ``~key``,
    ``hydra.*`` and free-form ``dict`` sections are left to Hydra and :func:`validate`.

    Raises:
        ValueError: ``config: no key 'algo.lrr' (did you mean 'algo.lr'?) ...``.
    """
    dirs = [Path(d) for d in config_dirs]
    chosen = _chosen_options(dirs, config_name, argv)
    for arg in argv:
        key, eq, _ = str(arg).partition("=")
        if not eq or key.startswith(("+", "~", "-", "hydra.", "hydra/")) or "@" in key:
            continue
        parts = key.split(".")
        if len(parts) == 1 and parts[0] in groups:  # picks a group option: Hydra's business
            continue
        _check_key(schema, parts, groups, chosen, dirs)


def _chosen_options(dirs: list[Path], config_name: str, argv: Iterable[str]) -> dict[str, str]:
    """``group -> option`` the launch picks: the defaults of the primary config (after those of
    the configs it starts from), then ``group=option`` overrides."""
    chosen: dict[str, str] = {}
    for node in _primary_chain(dirs, config_name):
        for item in node.get("defaults") or []:
            for key, option in item.items() if isinstance(item, dict) else ():
                if option is not None:  # `- model: tiny` or `- override data: tool_arithmetic`
                    chosen[str(key).removeprefix("override").strip().lstrip("/")] = str(option)
    for arg in argv:
        key, eq, value = str(arg).partition("=")
        if eq and "." not in key and not key.startswith(("+", "~", "-")):
            chosen[key] = value
    return chosen


def _group_schema(
    group: str, option: str | None, registry: Registry, dirs: list[Path]
) -> type | None:
    """The schema a group option's YAML names (``defaults: [schema_<name>]``), or ``None``."""
    if option is None:
        return None
    path = next(
        (d / group / f"{option}.yaml" for d in dirs if (d / group / f"{option}.yaml").is_file()),
        None,
    )
    if path is None:
        name = option.removeprefix("schema_")
        return registry[name].config if name in registry else None
    node = yaml.safe_load(path.read_text()) or {}
    for item in node.get("defaults") or []:
        if isinstance(item, str) and item.startswith("schema_") and item[7:] in registry:
            return registry[item[7:]].config
    return None  # untyped (e.g. a _component_ option): validate() checks it


def _check_key(
    schema: type,
    parts: list[str],
    groups: Mapping[str, Registry],
    chosen: Mapping[str, str],
    dirs: list[Path],
) -> None:
    node, done = schema, []
    for part in parts:
        if node is None:
            return
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            where = ".".join(done)
            hint = closest(part, fields).replace("'", f"'{where}." if where else "'", 1)
            raise ValueError(f"config: no key {'.'.join(parts)!r}{hint}; `--help` lists every key")
        done.append(part)
        if not done[1:] and part in groups:
            node = _group_schema(part, chosen.get(part), groups[part], dirs)
            continue
        node = _dataclass_of(node, part)


def _dataclass_of(schema: type, name: str) -> type | None:
    """The dataclass type of field ``name`` (``None``: a leaf, ``Any`` or a free-form dict)."""
    hint = typing.get_type_hints(schema).get(name)
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


# --------------------------------------------------------------------------- --help
_KEY = re.compile(r"^(\s*)([A-Za-z_]\w*):")


def _options(config_dir: Path) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for path in sorted(config_dir.rglob("*.yaml")):
        rel = path.relative_to(config_dir)
        if len(rel.parts) > 1:
            groups.setdefault("/".join(rel.parts[:-1]), []).append(path.stem)
    return groups


def _defaults(text: str) -> list[tuple[str, str]]:
    """``(group, option)`` of a YAML file's ``defaults`` list (schemas and ``_self_`` skipped)."""
    found, inside = [], False
    for line in text.splitlines():
        if line.startswith("defaults:"):
            inside = True
            continue
        if inside and not line.startswith(" "):
            break
        item = re.match(r"\s*-\s*([\w/]+)\s*:\s*([\w.]+)", line)
        if inside and item:
            found.append((item.group(1), item.group(2)))
    return found


def _documented(text: str, indent: str = "  ") -> list[str]:
    """The YAML's key lines with their comments (the ``defaults`` and ``hydra`` blocks left out)."""
    lines, skipping = [], False
    for line in text.splitlines():
        if not line.startswith(" ") and line.strip():
            skipping = line.startswith(("defaults:", "hydra:"))
        if not skipping and _KEY.match(line):
            lines.append(indent + line)
    return lines


def render_help(
    config_dir: Path,
    config_name: str,
    *,
    app: str,
    header: str,
    overrides: Iterable[str] = (),
    command: str | None = None,
) -> str:
    """``--help`` of a recipe: the groups and their options, then every key of the primary config
    and of the selected group options, each with its comment from the YAML files; ``command``:
    how the recipe was started (default ``python examples/<app>.py``)."""
    chosen = dict(_defaults((config_dir / f"{config_name}.yaml").read_text()))
    for override in overrides:  # `algo=grpo` picks another option of a group
        key, _, value = override.partition("=")
        if key in chosen and value:
            chosen[key] = value
    out = [header.rstrip(), "", "Config groups (pick one with group=option):"]
    for group, options in _options(config_dir).items():
        picked = chosen.get(group)
        shown = [f"[{o}]" if o == picked else o for o in options]
        out.append(f"  {group}: {', '.join(shown)}")
    primary = config_dir / f"{config_name}.yaml"
    out += ["", f"Keys of {primary.name} (override with key=value):"]
    out += _documented(primary.read_text())
    for group, option in chosen.items():
        path = config_dir / group / f"{option}.yaml"
        if path.is_file():
            out += ["", f"Keys of {group}={option} (override with {group}.key=value):"]
            out += _documented(path.read_text())
    command = command or f"python examples/{app}.py"
    out += ["", f"Run: {command} [group=option ...] [key=value ...]"]
    return "\n".join(out) + "\n"
