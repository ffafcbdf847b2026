"""Typed recipe configurations: schemas from the registries, validation, and ``--help``.

A recipe's configuration is a tree of dataclasses: its own sections plus, for each config group
(``model``, ``backend``, ``data``, ``reward``), the schemas the component registries carry
(:mod:`ar_torchrl.registry`). :func:`group_schemas` lists them as ``(group, "schema_<name>",
schema)`` for Hydra's ConfigStore (the entry point stores them; YAML options name theirs in
``defaults``), so Hydra rejects a wrong type or an unknown key while composing. :func:`validate`
then builds the typed object, rejects keys that no schema reads (added with ``+key=value``, which
Hydra allows), and runs every section's range checks. Nothing here imports torch or Hydra.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ar_torchrl.registry import Registry, closest

__all__ = ["group_schemas", "render_help", "unknown_keys", "validate"]


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


def validate(raw: DictConfig, schema: type, *, prefix: str = "config: ") -> Any:
    """The typed, checked configuration (interpolations resolved).

    Raises:
        ValueError, TypeError: a value out of range, of the wrong type, missing, or a key that no
            schema reads, naming the key.
    """
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
    config_dir: Path, config_name: str, *, app: str, header: str, overrides: Iterable[str] = ()
) -> str:
    """``--help`` of a recipe: the groups and their options, then every key of the primary config
    and of the selected group options, each with its comment from the YAML files."""
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
    out += ["", f"Run: python examples/{app}.py [group=option ...] [key=value ...]"]
    return "\n".join(out) + "\n"
