"""Generated one-shot arithmetic (ar_torchrl.data.tasks): problems, prompts, disjoint splits."""

from __future__ import annotations

import pytest

from ar_torchrl.data.tasks import arithmetic_task_split, fewshot_rows, problem_space
from ar_torchrl.rewards.math import dapo_math_reward


def test_problem_space_enumerates_every_pair_once():
    space = problem_space(["+", "-", "*"], 0, 3)
    assert len(space) == len(set(space)) == 3 * 16
    assert (3, "-", 0) in space and (0, "*", 3) in space


@pytest.mark.parametrize(
    ("ops", "lo", "hi", "message"),
    [
        (["/"], 0, 9, r"ops must be a non-empty subset of \['\+', '-', '\*'\], got \['/'\]"),
        ([], 0, 9, "ops must be a non-empty subset"),
        (["+"], 5, 2, "need 0 <= min_operand <= max_operand, got 5, 2"),
    ],
)
def test_problem_space_bad_input(ops, lo, hi, message):
    with pytest.raises(ValueError, match=message):
        problem_space(ops, lo, hi)


def test_fewshot_rows_prompt_and_answer():
    rows = fewshot_rows(
        [(12, "-", 5), (3, "*", 4)], [(1, "+", 1), (2, "+", 2), (3, "*", 4)], shots=2, seed=3
    )
    for row, truth in zip(rows, ["7", "12"]):
        messages = row["prompt"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 2 + ["user"]
        assert row["reward_model"]["ground_truth"] == truth
        for question, answer in zip(messages[0:4:2], messages[1:4:2]):  # the shots are solved
            a, op, b = question["content"].removeprefix("What is ").removesuffix("?").split()
            value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert answer["content"] == f"Answer: {value}"
            assert question["content"] != messages[-1]["content"]  # never the row's own problem
    assert rows[0]["prompt"][-1]["content"] == "What is 12 - 5?"
    assert dapo_math_reward("Answer: 7", rows[0]["reward_model"]["ground_truth"]) == 1.0


def test_fewshot_rows_bad_input():
    with pytest.raises(ValueError, match=r"shot_pool has 0 problems other than \(1, '\+', 1\)"):
        fewshot_rows([(1, "+", 1)], [(1, "+", 1)], shots=1)
    with pytest.raises(ValueError, match="shots must be >= 0, got -1"):
        fewshot_rows([(1, "+", 1)], [(2, "+", 2)], shots=-1)


def test_split_holds_out_problems_not_rows():
    train, test = arithmetic_task_split(500, 40, ops=["+"], max_operand=19, seed=7)
    assert (len(train), len(test)) == (500, 40)

    def problems(ds):
        return {r["extra_info"]["problem"] for r in ds}

    def all_questions(ds):
        return {m["content"] for r in ds for m in r["prompt"] if m["role"] == "user"}

    assert len(problems(test)) == 40 and problems(train).isdisjoint(problems(test))
    test_questions = {r["prompt"][-1]["content"] for r in test}
    assert test_questions.isdisjoint(all_questions(train))  # not even as a shot
    assert not test_questions & {m["content"] for r in test for m in r["prompt"][:-1]}
    again, _ = arithmetic_task_split(500, 40, ops=["+"], max_operand=19, seed=7)
    assert list(again) == list(train)  # seeded


def test_split_bad_holdout():
    with pytest.raises(ValueError, match=r"holdout=100 must be in \(0, 100\)"):
        arithmetic_task_split(10, 100, max_operand=9)
