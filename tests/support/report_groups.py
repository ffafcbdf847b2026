"""A pytest plugin for tests/test_xdist_groups.py: after collection, writes ``<node id> <group>``
(``-`` for none) per test to the file ``$AR_TORCHRL_GROUPS_OUT``."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    with open(os.environ["AR_TORCHRL_GROUPS_OUT"], "w") as out:
        for item in items:
            groups = [mark.args[0] for mark in item.iter_markers("xdist_group")]
            out.write(f"{item.nodeid} {groups[0] if groups else '-'}\n")
