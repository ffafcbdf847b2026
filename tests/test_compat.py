"""Old import paths and names (``ar_torchrl._compat``): each still works for one release, warns with
its new home, and is the very object found there."""

from __future__ import annotations

import importlib
import sys

import pytest

from ar_torchrl import _compat


@pytest.mark.parametrize("old", sorted(_compat.MOVED))
def test_a_moved_module_is_its_new_home_with_a_warning(old):
    new = _compat.MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


@pytest.mark.parametrize("old", sorted(_compat.RENAMED))
def test_a_renamed_name_is_the_new_object_with_a_warning(old):
    new = _compat.RENAMED[old]
    package, _, name = old.rpartition(".")
    module, _, attr = new.rpartition(".")
    with pytest.warns(DeprecationWarning, match=rf"{old} is now {new}"):
        value = getattr(importlib.import_module(package), name)
    assert value is getattr(importlib.import_module(module), attr)


def test_an_unknown_name_is_still_an_attribute_error():
    import ar_torchrl.training

    with pytest.raises(AttributeError, match="has no attribute 'plan_micro_batchez'"):
        ar_torchrl.training.plan_micro_batchez  # noqa: B018
