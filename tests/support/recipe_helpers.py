"""Composing the recipe's configuration in-process, as ``examples/dapo_ppo.py`` does under Hydra.

The entry point stores the registries' schemas in Hydra's ConfigStore (Hydra stays out of the
library); tests that compose a configuration themselves do the same here.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore

from ar_torchrl.recipes import dapo_ppo
from ar_torchrl.recipes.config import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = CONFIG_DIR  # ar_torchrl/configs/, shipped in the wheel


def store_schemas() -> None:
    """What ``examples/dapo_ppo.py`` does at import: every schema in Hydra's ConfigStore."""
    for group, name, schema in dapo_ppo.schemas():
        ConfigStore.instance().store(group=group, name=name, node=schema)


def load(overrides=(), name: str = "dapo_ppo"):
    """The composed (raw) configuration ``name`` with ``overrides``."""
    store_schemas()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def typed(overrides=(), name: str = "dapo_ppo") -> dapo_ppo.Config:
    """The validated, typed configuration."""
    return dapo_ppo.validate_config(load(overrides, name))
