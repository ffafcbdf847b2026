"""scripts/test.sh runs 2 pytest-xdist workers with ``--dist loadgroup``: tests sharing a costly
fixture must land on one worker (tests/support/xdist_groups.py; the SGLang server and the recipe-run
fixtures are built once per worker that needs them). Runs a throwaway suite on the installed pytest
and pytest-xdist."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

pytest.importorskip("xdist")


def test_a_group_runs_on_one_worker_and_the_rest_spreads(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            from support.xdist_groups import tag_group

            def pytest_collection_modifyitems(config, items):
                for item in items:
                    if item.name.startswith("test_grouped"):
                        tag_group(item, "g", loadgroup=bool(getattr(config.option, "loadgroup", False)))
            """
        )
    )
    (tmp_path / "test_throwaway.py").write_text(
        textwrap.dedent(
            """
            import os, time, pytest

            @pytest.mark.parametrize("i", range(6))
            def test_grouped(i):
                time.sleep(0.2)
                with open(f"grouped-{i}", "w") as f:
                    f.write(os.environ["PYTEST_XDIST_WORKER"])

            @pytest.mark.parametrize("i", range(6))
            def test_free(i):
                time.sleep(0.2)
                with open(f"free-{i}", "w") as f:
                    f.write(os.environ["PYTEST_XDIST_WORKER"])
            """
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-n",
        "2",
        "--dist",
        "loadgroup",
        "-p",
        "no:cacheprovider",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    grouped = {(tmp_path / f"grouped-{i}").read_text() for i in range(6)}
    free = [(tmp_path / f"free-{i}").read_text() for i in range(6)]
    assert len(grouped) == 1, f"the group ran on workers {sorted(grouped)}"
    assert set(free) <= {"gw0", "gw1"} and len(free) == 6


def test_group_names_with_the_separator_are_refused():
    from support.xdist_groups import tag_group

    with pytest.raises(ValueError, match="may not contain '@', got 'a@b'"):
        tag_group(None, "a@b", loadgroup=True)
