"""DAPO's rule-based math reward and soft overlong punishment (arXiv:2503.14476).

The reward follows DAPO's reference scorer (``verl/utils/reward_score/math_dapo.py``, Minerva
normalisation): only the last 300 characters of the response are searched, the answer is the text
after the *last* ``Answer:`` (case-insensitive) up to the end of its line, both answer and ground truth
are normalised the same way, and the reward is ``+1`` on an exact string match, else ``-1``.
Departure (opt-in only): ``use_math_verify=True`` also accepts answers that the ``math-verify``
package proves equivalent (e.g. ``0.5`` vs ``\\frac{1}{2}``).
"""

from __future__ import annotations

import importlib
import importlib.util
import re

__all__ = ["dapo_math_reward", "extract_answer", "normalize_final_answer", "overlong_penalty"]

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
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
    "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
    "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ",
    "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
_REGEX_REWRITES = (
    (r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"),  # keep only the first $...$ span
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
    for pattern, repl in _REGEX_REWRITES:
        answer = re.sub(pattern, repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


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


def _math_verify_equal(pred: str, truth: str) -> bool:
    if importlib.util.find_spec("math_verify") is None:
        raise ImportError(
            "dapo_math_reward(use_math_verify=True) needs the `math-verify` package: "
            "pip install 'ar_torchrl[math]'"
        )
    math_verify = importlib.import_module("math_verify")
    try:
        gold, answer = math_verify.parse(f"${truth}$"), math_verify.parse(f"${pred}$")
        return bool(math_verify.verify(gold, answer))
    except Exception:  # math-verify's parser raises on malformed TeX: not equivalent
        return False


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
    truth = normalize_final_answer(str(ground_truth))
    if pred == truth:
        return 1.0
    if use_math_verify and raw is not None and _math_verify_equal(pred, truth):
        return 1.0
    return -1.0


def overlong_penalty(
    length: int, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> float:
    """DAPO's soft overlong punishment (a value ``<= 0`` added to the task reward).

    With ``expected = max_len - buffer_len``: ``min(0, -(length - expected) / buffer_len *
    penalty_factor)``, i.e. 0 up to ``expected`` tokens, then linear down to ``-penalty_factor`` at
    ``max_len`` (and below it beyond, as in DAPO's code).

    Args:
        length: generated tokens of the response.
        max_len: the generation cap (``max_new_tokens``).
        buffer_len: length of the punishment interval before ``max_len``.
        penalty_factor: penalty at ``length == max_len``.

    Example:
        >>> overlong_penalty(10, max_len=20, buffer_len=5), overlong_penalty(20, 20, 5, 1.0)
        (0.0, -1.0)
        >>> overlong_penalty(17, 20, 4, 0.5)
        -0.125
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"overlong_penalty: buffer_len must be in (0, max_len={max_len}], got {buffer_len}"
        )
    if length < 0:
        raise ValueError(f"overlong_penalty: length must be >= 0, got {length}")
    expected = max_len - buffer_len
    return min(0.0, -(length - expected) / buffer_len * penalty_factor)
