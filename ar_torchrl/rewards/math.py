"""DAPO's rule-based math reward and soft overlong punishment (arXiv:2503.14476).

The reward follows DAPO's reference scorer (``verl/utils/reward_score/math_dapo.py``, Minerva
normalisation): only the last 300 characters of the response are searched, the answer is the text
after the *last* ``Answer:`` (case-insensitive) up to the end of its line, both answer and ground truth
are normalised the same way, and the reward is ``+1`` on an exact string match, else ``-1``.
Departure (opt-in only): ``use_math_verify=True`` also accepts answers that the ``math-verify``
package proves equivalent (e.g. ``0.5`` vs ``\\frac{1}{2}``), with the same answer in any thread.

Bounded work: the response is searched in its last 300 characters only; each ground truth is
normalised once (cached) in linear time; math-verify is not consulted for ground truths longer than
:data:`MATH_VERIFY_MAX_CHARS` (counted in :func:`reward_stats`, logged once).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections import Counter
from dataclasses import dataclass
from functools import partial

from ar_torchrl.rewards._math_verify_worker import (
    MathVerifyWorker,
    math_verify_equal,
    require_math_verify,
)
from ar_torchrl.rewards.registry import TaskReward, register_reward
from ar_torchrl.rewards.shaping import overlong_penalty

__all__ = [
    "MATH_VERIFY_MAX_CHARS",
    "ArithmeticReward",
    "ArithmeticRewardConfig",
    "DapoMathRewardConfig",
    "dapo_math_reward",
    "extract_answer",
    "normalize_final_answer",
    "overlong_penalty",
    "reward_stats",
]

logger = logging.getLogger(__name__)

#: Characters searched for the answer (DAPO: the longest MATH-500 answer is under 200 characters).
SEARCH_WINDOW = 300
ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID = "[INVALID]"

# Minerva / DAPO normalisation tables: applied in this order, as plain string replacements.
_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
#: Ground truths longer than this are compared as normalised strings only (no math-verify).
MATH_VERIFY_MAX_CHARS = 1000
_STATS: Counter = Counter()
_WORKER = MathVerifyWorker()
_REGEX_REWRITES = (
    (r"(\\text\{)(.*?)(\})", "\\2"),
    (r"(\\textbf\{)(.*?)(\})", "\\2"),
    (r"(\\overline\{)(.*?)(\})", "\\2"),
    (r"(\\boxed\{)(.*)(\})", "\\2"),
    (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
    (r"(sqrt)([^{])", "sqrt{\\2}"),  # \sqrta -> \sqrt{a}
)


def normalize_final_answer(answer: str) -> str:
    """Normalise an answer string as DAPO/Minerva do (text after the last ``=``, units and TeX stripped).

    Example:
        >>> normalize_final_answer("x = \\\\boxed{1,000} dollars")
        '1000'
        >>> normalize_final_answer("$\\\\frac12$")
        '\\\\frac{1}{2}'
    """
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    answer = _first_dollar_span(answer)
    for pattern, repl in _REGEX_REWRITES:
        answer = re.sub(pattern, repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _first_dollar_span(answer: str) -> str:
    """Minerva's ``re.sub(r"(.*?)(\\$)(.*?)(\\$)(.*)", "$\\3$", answer)`` in linear time.

    ``.`` stops at newlines, so the regex rewrites each line holding two or more ``$`` to its first
    ``$...$`` span and leaves the others; on a line without two ``$`` it retried from every
    position (quadratic: 9 s for a 20,000-character ground truth).
    """
    lines = answer.split("\n")
    for i, line in enumerate(lines):
        first = line.find("$")
        second = line.find("$", first + 1) if first >= 0 else -1
        if second >= 0:
            lines[i] = "$" + line[first + 1 : second] + "$"
    return "\n".join(lines)


@functools.lru_cache(maxsize=65536)
def _normalized_truth(truth: str) -> str:
    return normalize_final_answer(truth)


def reward_stats() -> dict[str, int]:
    """Counters of this process: ``math_verify_calls``, ``math_verify_worker_calls`` (off the main
    thread), ``math_verify_skipped_long`` (ground truth over :data:`MATH_VERIFY_MAX_CHARS`),
    ``math_verify_failed`` (the worker died or timed out: scored as not equivalent)."""
    return dict(_STATS)


def _math_verify_equal(pred: str, truth: str) -> bool:
    """math-verify in a main thread: here on the main thread, else in the worker process."""
    if len(truth) > MATH_VERIFY_MAX_CHARS:
        if not _STATS["math_verify_skipped_long"]:
            logger.warning(
                "ground truth of %d characters (> %d): compared as a string only, "
                "without math-verify (counted in reward_stats())",
                len(truth),
                MATH_VERIFY_MAX_CHARS,
            )
        _STATS["math_verify_skipped_long"] += 1
        return False
    require_math_verify()  # a missing package is an error in every thread, never a silent -1
    _STATS["math_verify_calls"] += 1
    if threading.current_thread() is threading.main_thread():
        return math_verify_equal(pred, truth)
    _STATS["math_verify_worker_calls"] += 1
    answer = _WORKER.equal(pred, truth)
    if answer is None:
        _STATS["math_verify_failed"] += 1
        return False
    return answer


def extract_answer(response_text: str) -> str | None:
    """The raw text after the last ``Answer:`` in the last 300 characters, or ``None``.

    Example:
        >>> extract_answer("Answer: 3\\nwait\\nanswer: 4")
        '4'
        >>> extract_answer("no final line") is None
        True
    """
    matches = ANSWER_PATTERN.findall(response_text[-SEARCH_WINDOW:])
    return matches[-1] if matches else None


def dapo_math_reward(
    response_text: str, ground_truth: str, *, use_math_verify: bool = False
) -> float:
    """DAPO's verifiable reward: ``+1.0`` if the last ``Answer:`` line matches, else ``-1.0``.

    Args:
        response_text: the decoded response (special tokens stripped).
        ground_truth: the reference answer (``reward_model.ground_truth`` of a DAPO row).
        use_math_verify: also accept answers ``math-verify`` proves equivalent (needs the
            ``math`` extra; a missing package is an error, never a silent fallback).

    Example:
        >>> dapo_math_reward("7 + 5 = 12\\nAnswer: 12", "12")
        1.0
        >>> dapo_math_reward("Answer: 12\\nAnswer: 13", "12")
        -1.0
        >>> dapo_math_reward("The answer is 12", "12")
        -1.0
    """
    raw = extract_answer(response_text)
    pred = normalize_final_answer(raw if raw is not None else INVALID)
    truth = _normalized_truth(str(ground_truth))
    if pred == truth:
        return 1.0
    if use_math_verify and raw is not None and _math_verify_equal(pred, truth):
        return 1.0
    return -1.0


@register_reward("dapo_math", help="DAPO's +1/-1 rule on the last Answer: line (correct: +1)")
@dataclass
class DapoMathRewardConfig:
    """``reward=dapo_math``: :func:`dapo_math_reward` on DAPO-schema rows; an answer is correct when
    it scores ``+1`` (above 0)."""

    use_math_verify: bool = False  # also accept answers math-verify proves equivalent

    def check(self, prefix: str) -> None:
        from ar_torchrl.utils.checks import check_bool

        check_bool(prefix, "use_math_verify", self.use_math_verify)

    def build(self) -> TaskReward:
        fn = partial(dapo_math_reward, use_math_verify=self.use_math_verify)
        return TaskReward(fn, correct_above=0.0, name="dapo_math")


@dataclass(frozen=True)
class ArithmeticReward:
    """+1 when the last ``Answer:`` line equals the value of the row's ``extra_info.problem``
    (``"7 * 8"``: computed here, not read from DAPO's ``reward_model.ground_truth``), else -1; minus
    ``length_penalty`` per response token. Correct: the answer's value is right, whatever its length.

    Example:
        >>> from ar_torchrl.data.samples import Sample, Segment
        >>> r = ArithmeticReward(length_penalty=0.01)
        >>> s = Sample([Segment([1]), Segment([5] * 10, trained=True)],
        ...            row={"extra_info": {"problem": "7 * 8"}}, text="7 * 8 = 56\\nAnswer: 56")
        >>> round(r.score(s), 4), r.correct(s, r.score(s))
        (0.9, True)
    """

    length_penalty: float = 0.0
    name: str = "arithmetic"

    def _right(self, sample) -> bool:
        problem = (sample.row or {}).get("extra_info", {}).get("problem")
        if not isinstance(problem, str) or len(problem.split()) != 3:
            raise KeyError(
                f"reward arithmetic: {sample.source or 'the row'} has no extra_info.problem of the form "
                f"'a op b' (got {problem!r}); it scores the arithmetic tasks (data=fewshot_arithmetic)"
            )
        from ar_torchrl.data.tasks import OPS

        a, op, b = problem.split()
        answer = extract_answer(sample.text or "")
        truth = str(OPS[op](int(a), int(b)))
        return answer is not None and normalize_final_answer(answer) == truth

    def score(self, sample) -> float:
        base = 1.0 if self._right(sample) else -1.0
        return base - self.length_penalty * sample.num_trained

    def correct(self, sample, score: float) -> bool:
        return self._right(sample)


@register_reward(
    "arithmetic",
    help="+1/-1 on the value of the row's extra_info.problem, minus a per-token length penalty",
)
@dataclass
class ArithmeticRewardConfig:
    """``reward=arithmetic``: :class:`ArithmeticReward` (a reward that reads a field outside DAPO's
    schema and the response's token count)."""

    length_penalty: float = 0.0  # subtracted per response token

    def check(self, prefix: str) -> None:
        from ar_torchrl.utils.checks import check_number

        check_number(prefix, "length_penalty", self.length_penalty, ge=0)

    def build(self) -> ArithmeticReward:
        return ArithmeticReward(length_penalty=self.length_penalty)
