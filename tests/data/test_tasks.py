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


# --------------------------------------------------------------------------- mixed difficulty
def test_mixed_split_levels_shots_and_disjoint_problems():
    from collections import Counter

    from ar_torchrl.data.tasks import MixedArithmeticDataConfig

    levels = ["+ 0-9", "+ 10-99", "* 10-99"]
    train, test = MixedArithmeticDataConfig(num_rows=3000, levels=levels, holdout=64).build()
    assert (len(train), len(test)) == (3000, 64)
    assert Counter(r["extra_info"]["level"] for r in test) == {
        "+ 0-9": 22,
        "+ 10-99": 21,
        "* 10-99": 21,
    }
    drawn = Counter(r["extra_info"]["level"] for r in train)
    assert set(drawn) == set(levels) and min(drawn.values()) > 900  # drawn uniformly
    held_questions = {r["prompt"][-1]["content"] for r in test}
    for ds in (train, test):
        for i, r in enumerate(ds):
            a, op, b = r["extra_info"]["problem"].split()
            low, high = (0, 9) if r["extra_info"]["level"] == "+ 0-9" else (10, 99)
            assert op == r["extra_info"]["level"][0] and low <= int(a) <= high >= int(b) >= low
            value = int(a) + int(b) if op == "+" else int(a) * int(b)
            assert r["reward_model"]["ground_truth"] == str(value) and r["extra_info"]["index"] == i
            assert dapo_math_reward(f"Answer: {value}", r["reward_model"]["ground_truth"]) == 1.0
            messages = r["prompt"]
            assert len(messages) == 7 and messages[-1]["content"] == f"What is {a} {op} {b}?"
            for question, answer in zip(messages[:-1:2], messages[1:-1:2]):
                x, shot_op, y = question["content"][len("What is ") : -1].split()
                assert shot_op == op and low <= int(x) <= high  # a shot of the row's own level
                assert question["content"] != messages[-1]["content"]
                assert (
                    answer["content"]
                    == f"Answer: {int(x) + int(y) if op == '+' else int(x) * int(y)}"
                )
                assert question["content"] not in held_questions  # held out: not even a shot
    train_problems = {r["extra_info"]["problem"] for r in train}
    assert train_problems.isdisjoint(r["extra_info"]["problem"] for r in test)
    again, _ = MixedArithmeticDataConfig(num_rows=3000, levels=levels, holdout=64).build()
    assert list(again) == list(train)  # seeded


def test_parse_level_and_bad_mixed_input():
    from ar_torchrl.data.tasks import mixed_arithmetic_split, parse_level

    assert parse_level(" - 3-12 ") == ("-", 3, 12)
    for bad in ["/ 0-9", "+ 9-0", "+0-9", "+ 0-x", "+ 5"]:
        with pytest.raises(ValueError, match=r"must read 'OP LOW-HIGH' with OP one of"):
            parse_level(bad)
    with pytest.raises(ValueError, match=r"levels must be distinct and non-empty"):
        mixed_arithmetic_split(10, 2, levels=["+ 0-9", "+ 0-9"])
    with pytest.raises(
        ValueError, match=r"leave at least half of the 4 problems of level '\+ 0-1'"
    ):
        mixed_arithmetic_split(10, 6, levels=["+ 0-1", "* 10-99"])
    with pytest.raises(ValueError, match=r"need num_rows >= 1 and shots >= 0, got 0, 3"):
        mixed_arithmetic_split(0, 2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"levels": ["+ 0-9", "x 1-2"]}, r"config: data.levels: level 'x 1-2' must read 'OP LOW"),
        ({"levels": []}, r"config: data.levels must be distinct and non-empty, got \[\]"),
        ({"levels": ["+ 0-9", "+ 0-9"]}, r"levels must be distinct and non-empty"),
        ({"holdout": 0}, "holdout"),
        ({"shots": -1}, "shots"),
        ({"num_rows": 0}, "num_rows"),
        (
            {"levels": ["+ 0-3", "* 10-99"], "holdout": 40},
            r"holdout=40 holds out 20 of the 16 problems of level '\+ 0-3': at most half",
        ),
    ],
)
def test_mixed_config_rejects_bad_values(options, message):
    from ar_torchrl.data.tasks import MixedArithmeticDataConfig

    with pytest.raises(ValueError, match=message):
        MixedArithmeticDataConfig(**options).check("config: data.")


def test_smollm2_arithmetic_mixed_config_is_smollm2_arithmetic_with_the_mixed_task():
    from support.recipe_helpers import typed

    from ar_torchrl.data.tasks import MixedArithmeticDataConfig

    mixed, plain = typed(name="smollm2_arithmetic_mixed"), typed(name="smollm2_arithmetic")
    assert isinstance(mixed.data, MixedArithmeticDataConfig) and mixed.data.shots == 3
    assert (mixed.model, mixed.algo, mixed.rollout) == (plain.model, plain.algo, plain.rollout)
    assert mixed.logger.exp_name == "smollm2_arithmetic_mixed"
