"""scripts/test.sh runs 2 pytest-xdist workers with ``--dist loadgroup``: tests sharing a costly
fixture must land on one worker (tests/support/xdist_groups.py; the SGLang server and the recipe-run
fixtures are built once per worker that needs them). Runs a throwaway suite on the installed pytest
and pytest-xdist."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

pytest.importorskip("xdist")


@pytest.mark.slow  # two pytest processes (~10 s): full tier only, the fast tier stays under 3 min
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
                        tag_group(item, "g")
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
        tag_group(None, "a@b")


@pytest.mark.slow  # collects five test files in a pytest process (~15 s)
def test_the_suite_groups_the_tests_that_share_a_costly_fixture(tmp_path):
    """tests/conftest.py's groups, read off a real collection: every SGLang test in one group
    (one server), the recipe-run fixtures' users in theirs, a module-scoped fixture's module in its
    own, and a plain test in none."""
    out = tmp_path / "groups.txt"
    files = [
        "tests/weight_sync/test_weight_sync_disk.py",  # sglang_server
        "tests/backends/sglang/test_sglang_router.py",  # sglang, a module-scoped router
        "tests/recipes/test_recipe_critic.py",  # separate_run
        "tests/envs/test_llm_env.py",  # module-scoped model
        "tests/utils/test_checks.py",  # nothing shared
    ]
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "support.report_groups"]
    env = {**os.environ, "AR_TORCHRL_GROUPS_OUT": str(out), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    group = {}
    for line in out.read_text().splitlines():
        nodeid, name = line.rsplit(" ", 1)
        group[nodeid.split("[")[0]] = name
    want = {
        "tests/weight_sync/test_weight_sync_disk.py::test_disk_sync_in_shards": "sglang",
        "tests/weight_sync/test_weight_sync_disk.py::test_a_missing_config_source_is_named": "-",
        "tests/backends/sglang/test_sglang_router.py::test_no_router_outlives_its_backend": "sglang",
        "tests/backends/sglang/test_sglang_router.py::test_router_keys_are_checked": "-",
        "tests/recipes/test_recipe_critic.py::test_critic_warmup_leaves_the_policy_bit_identical": (
            "tool-runs"
        ),
        "tests/recipes/test_recipe_critic.py::test_lr_schedule_factor_matches_a_loop": "-",
        "tests/envs/test_llm_env.py::test_scripted_rewards_and_overlong_penalty": (
            "tests/envs/test_llm_env.py"
        ),
        "tests/utils/test_checks.py::test_clip_epsilon_and_grad_clip": "-",
    }
    assert {k: group.get(k) for k in want} == want
