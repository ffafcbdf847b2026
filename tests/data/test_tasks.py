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


# --------------------------------------------------------------------------- critic arithmetic
def test_column_trace_is_right_and_scored_right_for_every_small_problem():
    import random

    from ar_torchrl.data.tasks import column_trace

    rng = random.Random(0)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    pairs += [(rng.randint(10, 999), rng.randint(10, 999)) for _ in range(300)]
    for a, b in pairs:
        text, right = column_trace(a, b)
        assert right and dapo_math_reward(text, str(a + b)) == 1.0
        lines = text.splitlines()
        assert len(lines) == len(str(max(a, b))) + 1 and lines[-1] == f"Answer: {a + b}"
    assert column_trace(987, 654)[0] == "7+4=11\n8+5+1=14\n9+6+1=16\nAnswer: 1641"


def test_a_wrong_column_decides_the_outcome_and_the_answer_follows_the_columns():
    """Noisy traces: the answer is made of the *written* sums (the carry follows them too), so it
    is wrong exactly when a column is; each column is right with the given accuracy."""
    import random

    from ar_torchrl.data.tasks import column_trace

    rng = random.Random(1)
    columns = right_columns = 0
    for _ in range(2000):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        text, right = column_trace(a, b, accuracy=0.7, rng=rng)
        *lines, answer = text.splitlines()
        written, carry, digits = [], 0, []
        for k, line in enumerate(lines):
            terms, total = line.split("=")
            x, y, *c = map(int, terms.split("+"))
            assert (x, y) == (a // 10**k % 10, b // 10**k % 10) and c == ([1] if carry else [])
            columns += 1
            right_columns += int(total) == x + y + carry
            carry = int(int(total) >= 10)
            written.append(int(total))
            digits.append(total if k == len(lines) - 1 else str(int(total) % 10))
        assert answer == "Answer: " + "".join(reversed(digits))
        assert right == (int(answer.split()[-1]) == a + b)
        assert (dapo_math_reward(text, str(a + b)) == 1.0) == right
    assert right_columns / columns == pytest.approx(0.7, abs=0.02)


def test_critic_arithmetic_rows_format_and_difficulty():
    from ar_torchrl.data.tasks import COLUMN_TEMPLATE, critic_arithmetic_rows

    rows = critic_arithmetic_rows([(7, 5), (57, 38), (999, 1)])
    assert [r["prompt"] for r in rows] == [
        [{"role": "user", "content": "7 + 5"}],
        [{"role": "user", "content": "57 + 38"}],
        [{"role": "user", "content": "999 + 1"}],
    ]
    assert COLUMN_TEMPLATE == "{a} + {b}"
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["12", "95", "1000"]
    assert [(r["extra_info"]["digits"], r["extra_info"]["carries"]) for r in rows] == [
        (1, 1),
        (2, 1),
        (3, 3),
    ]
    assert rows.ground_truth(1) == "95" and rows[2]["data_source"] == "critic_arithmetic"


def test_critic_arithmetic_split_spreads_difficulty_and_holds_out_problems():
    from collections import Counter

    from ar_torchrl.data.tasks import CriticArithmeticDataConfig

    train, test = CriticArithmeticDataConfig(num_rows=3000, holdout=63, seed=3).build()
    assert (len(train), len(test)) == (3000, 63)

    def problems(ds):
        return {r["extra_info"]["problem"] for r in ds}

    assert len(problems(test)) == 63 and problems(train).isdisjoint(problems(test))
    assert Counter(r["extra_info"]["digits"] for r in test) == {1: 21, 2: 21, 3: 21}
    digits = Counter(r["extra_info"]["digits"] for r in train)
    assert set(digits) == {1, 2, 3} and min(digits.values()) > 900  # drawn uniformly
    carries = Counter(r["extra_info"]["carries"] for r in train)
    assert set(carries) == {0, 1, 2, 3} and min(carries.values()) > 100  # easy and hard rows
    for r in train:  # the operands have the row's digit count
        a, _, b = r["extra_info"]["problem"].split()
        assert len(a) == len(b) == r["extra_info"]["digits"]
    again, _ = CriticArithmeticDataConfig(num_rows=3000, holdout=63, seed=3).build()
    assert list(again) == list(train)  # seeded


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"digits": []}, r"digits must be a non-empty list of integers in \[1, 6\], got \[\]"),
        ({"digits": [1, 7]}, r"digits must be a non-empty list of integers in \[1, 6\]"),
        ({"digits": [2, 2]}, r"digits has duplicates: \[2, 2\]"),
        ({"holdout": 0}, "holdout"),
        ({"holdout": 200, "digits": [1, 2]}, "holdout=200 holds out more than half of the 100"),
        ({"num_rows": 0}, "num_rows"),
    ],
)
def test_critic_arithmetic_config_rejects_bad_values(options, message):
    from ar_torchrl.data.tasks import CriticArithmeticDataConfig

    with pytest.raises(ValueError, match=message):
        CriticArithmeticDataConfig(**options).check("config: data.")


def test_critic_arithmetic_functions_reject_bad_input():
    from ar_torchrl.data.tasks import column_problems, column_trace, critic_arithmetic_split

    with pytest.raises(ValueError, match=r"accuracy must be in \[0, 1\], got 1.5"):
        column_trace(1, 2, accuracy=1.5)
    with pytest.raises(ValueError, match="operands must be >= 0, got -1 and 2"):
        column_trace(-1, 2)
    with pytest.raises(ValueError, match="num must be >= 0, got -1"):
        column_problems(-1)
    with pytest.raises(ValueError, match="leave at least half of the 100 problems with 1 digit"):
        critic_arithmetic_split(10, 200, digits=[1])
    with pytest.raises(ValueError, match="num_rows must be >= 1, got 0"):
        critic_arithmetic_split(0, 3)
