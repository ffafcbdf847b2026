"""Sending tests that share a costly fixture to one pytest-xdist worker (``--dist loadgroup``).

pytest-xdist 3.8 marks a grouped test by appending ``@<group>`` to its node id in the worker
(``item._nodeid``), and its scheduler sends all ids with one suffix to one worker. pytest 9.2 keeps
the node id in ``item._id`` and no longer reads ``_nodeid``, so on it that rewrite does nothing
and every group is scattered (seen: the SGLang server and the recipe-run fixtures built on both
workers; pytest-dev/pytest-xdist#1386, open, its fix #1388 not released). :func:`tag_group`
adds the ``xdist_group`` marker and, where pytest keeps ``_id``, writes the suffix itself;
``tests/test_xdist_groups.py`` pins the behaviour on the installed versions. Torch-free
(imported by a test's throwaway conftest).
"""

from __future__ import annotations

import pytest


def tag_group(item: pytest.Item, group: str) -> None:
    """Send ``item`` to the worker that runs every other test of ``group`` (the node id gets its
    suffix only where the run schedules by group: ``loadgroup`` in the item's config options).

    Args:
        item: a collected test.
        group: the group's name (no ``@``).
    """
    if "@" in group:
        raise ValueError(f"tag_group: a group name may not contain '@', got {group!r}")
    item.add_marker(pytest.mark.xdist_group(group))
    if (
        not getattr(item.config.option, "loadgroup", False)
        or hasattr(item, "_nodeid")
        or not hasattr(item, "_id")
    ):
        return  # pytest < 9.2 (pytest-xdist writes item._nodeid itself) or an unknown layout
    from _pytest.nodeid import NodeId  # pytest >= 9.2

    if not str(item._id).endswith(f"@{group}"):
        item._id = NodeId.parse(f"{item._id}@{group}")
