"""Doctest hygiene for ``pytest tests ar_torchrl``: the docstring examples make temporary
directories with ``tempfile.mkdtemp()`` (what a user copying them would write); while a doctest runs,
``tempfile`` puts them under the test's own ``tmp_path``, which pytest cleans up, instead of
leaving them in ``/tmp`` after every run."""

from __future__ import annotations

import tempfile

import pytest
from _pytest.doctest import DoctestItem


@pytest.fixture(autouse=True)
def _doctest_temp_dirs(request, monkeypatch):
    if isinstance(request.node, DoctestItem):
        monkeypatch.setattr(tempfile, "tempdir", str(request.getfixturevalue("tmp_path")))
    yield
