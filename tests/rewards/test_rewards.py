"""DAPO math reward (last `Answer:` line in the last 300 chars, Minerva normalisation) and overlong penalty."""

from __future__ import annotations

import importlib.util

import pytest

from ar_torchrl.rewards import (
    dapo_math_reward,
    extract_answer,
    normalize_final_answer,
    overlong_penalty,
)


@pytest.mark.parametrize(
    ("response", "truth", "reward"),
    [
        ("7 + 5 = 12\nAnswer: 12", "12", 1.0),
        ("Answer: 12", "13", -1.0),
        ("answer:12", "12", 1.0),  # case-insensitive, spaces optional
        ("ANSWER :   12  ", "12", 1.0),
        ("Answer: 13\nno wait\nAnswer: 12", "12", 1.0),  # the last Answer line wins
        ("Answer: 12\nAnswer: 13", "12", -1.0),
        ("The answer is 12", "12", -1.0),  # no `Answer:` line
        ("", "12", -1.0),
        ("Answer: \\boxed{12}", "12", 1.0),
        ("Answer: $12$", "12", 1.0),
        ("Answer: 12 dollars", "12", 1.0),
        ("Answer: 1,000", "1000", 1.0),
        ("Answer: x = 5", "5", 1.0),
        ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
        ("Answer: \\text{(B)}", "(B)", 1.0),
        ("Answer: 0.5", "\\frac{1}{2}", -1.0),  # equivalence needs math-verify (opt-in)
        ("Answer: 12.", "12", -1.0),  # DAPO does not strip a trailing period outside $...$
    ],
)
def test_dapo_math_reward_hand_cases(response, truth, reward):
    assert dapo_math_reward(response, truth) == reward


def test_only_the_last_300_characters_are_searched():
    assert dapo_math_reward("Answer: 12\n" + "x" * 289, "12") == 1.0  # 300 chars in total
    assert dapo_math_reward("Answer: 12\n" + "x" * 290, "12") == -1.0  # the `A` fell out
    assert extract_answer("Answer: 12\n" + "x" * 290) is None


def test_normalize_final_answer():
    assert normalize_final_answer("  42 ") == "42"
    assert normalize_final_answer("\\boxed{3\\sqrt2}") == "3\\sqrt{2}"
    assert normalize_final_answer("10^\\circ") == "10"
    assert normalize_final_answer("5 \\text{ cm}") == "5"


def test_math_verify_opt_in():
    if importlib.util.find_spec("math_verify") is None:
        with pytest.raises(ImportError, match=r"pip install 'ar_torchrl\[math\]'"):
            dapo_math_reward("Answer: 0.5", "\\frac{1}{2}", use_math_verify=True)
    else:
        assert dapo_math_reward("Answer: 0.5", "\\frac{1}{2}", use_math_verify=True) == 1.0
        assert dapo_math_reward("Answer: 0.6", "\\frac{1}{2}", use_math_verify=True) == -1.0
    assert dapo_math_reward("no answer", "12", use_math_verify=True) == -1.0  # never consulted


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (12, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (20, -1.0), (22, -1.5)],
)
def test_overlong_penalty(length, expected):
    # max_len 20, buffer 4: free up to 16 tokens, then -1/4 per token down to -1 at 20 (DAPO Eq. 13)
    assert overlong_penalty(length, max_len=20, buffer_len=4, penalty_factor=1.0) == pytest.approx(
        expected
    )


def test_overlong_penalty_factor_and_errors():
    assert overlong_penalty(20, 20, 4, penalty_factor=0.5) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match=r"buffer_len must be in \(0, max_len=20\], got 0"):
        overlong_penalty(10, 20, 0)
    with pytest.raises(ValueError, match="length must be >= 0, got -1"):
        overlong_penalty(-1, 20, 4)


# math-verify is in the `test` extra (pyproject): these tests need the real package.
@pytest.mark.parametrize(
    ("response", "truth", "reward"),
    [
        ("Answer: 0.5", "\\frac{1}{2}", 1.0),
        ("Answer: 0.6", "\\frac{1}{2}", -1.0),
        ("Answer: \\sqrt{4}", "2", 1.0),
        ("Answer: \\frac{", "2", -1.0),  # malformed TeX: not equivalent, in any thread
    ],
)
def test_math_verify_gives_the_same_answer_in_any_thread(response, truth, reward):
    """math-verify's signal.alarm only works on the main thread; a rollout thread used to get -1."""
    import threading

    from ar_torchrl.rewards import math as reward_math

    before = reward_math.reward_stats().get("math_verify_worker_calls", 0)
    main = dapo_math_reward(response, truth, use_math_verify=True)
    box = {}
    worker = threading.Thread(
        target=lambda: box.update(r=dapo_math_reward(response, truth, use_math_verify=True))
    )
    worker.start()
    worker.join(timeout=120)
    try:
        assert main == box["r"] == reward
        assert reward_math.reward_stats()["math_verify_worker_calls"] == before + 1
    finally:
        reward_math._WORKER.close()  # the worker process ends with the test
    assert reward_math._WORKER._proc is None


def test_dollar_span_rewrite_is_the_minerva_regex_in_linear_time():
    import random
    import re

    from ar_torchrl.rewards.math import _first_dollar_span

    rng = random.Random(0)
    for _ in range(5000):
        s = "".join(rng.choice("a$\n $b") for _ in range(rng.randint(0, 14)))
        assert _first_dollar_span(s) == re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s), repr(s)
    # a 20,000-character ground truth took 9 s per sample with the regex; now once, cached
    long_truth = "so the total is " + "x " * 10_000 + "= 42"
    assert normalize_final_answer(long_truth) == "42"
    assert dapo_math_reward("Answer: 42", long_truth) == 1.0


def test_ground_truths_are_normalised_once_and_long_ones_skip_math_verify():
    from ar_torchrl.rewards import math as reward_math

    truth = "\\frac{3}{4} + 0 \\cdot z_" + "q" * 5
    reward_math._normalized_truth.cache_clear()
    for _ in range(5):
        dapo_math_reward("Answer: 1", truth)
    info = reward_math._normalized_truth.cache_info()
    assert info.misses == 1 and info.hits == 4
    long_truth = "y" * (reward_math.MATH_VERIFY_MAX_CHARS + 1)
    before = reward_math.reward_stats().get("math_verify_skipped_long", 0)
    assert dapo_math_reward("Answer: 0.5", long_truth, use_math_verify=True) == -1.0
    assert reward_math.reward_stats()["math_verify_skipped_long"] == before + 1
