"""Property-based (hypothesis) tests of the calculator: any expression string (or JSON argument)
gives a number or a named error, quickly; well-formed small expressions agree with Python's own
arithmetic (the twin in support/expressions.py)."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.expressions import OPS, expression_text, expression_value
from support.fuzz import fuzz

from ar_torchrl.tools import Calculator, CalculatorError, format_number

#: Arithmetic-heavy pieces (and the refusals' syntax), so that random strings come close to sums.
PIECES = [
    *"0123456789.eE_jJ+-*/%()  ",
    "**",
    "//",
    "9**9",
    "1e308",
    "10**99",
    "0.0",
    "(-8)",
    "__import__",
    "x",
    "lambda: ",
    "[1]",
    "{}",
    "~",
    "<<",
    "not ",
    "'a'",
    "\\",
    "\x00",
    "١٢",
]

expressions = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(PIECES), max_size=40).map("".join),
    st.integers(0, 250).map(lambda n: "(" * n + "1" + ")" * n),
    st.integers(0, 250).map(lambda n: "-" * n + "1"),
)


def _number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


@fuzz(250)
@given(expression=expressions)
def test_any_expression_is_a_number_or_a_named_error_and_quick(expression):
    calc = Calculator()
    start = time.monotonic()
    try:
        result = calc(expression)
    except (CalculatorError, ZeroDivisionError):
        result = None
    assert time.monotonic() - start < 1.0, expression  # bounded: no huge power, no huge number
    assert result is None or _number(result), (expression, result)


json_arguments = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3)
    ),
    max_leaves=10,
)


@fuzz(150)
@given(arguments=json_arguments | st.builds(lambda v: {"expression": v}, json_arguments))
def test_any_json_argument_is_a_number_or_a_named_error(arguments):
    try:
        result = Calculator()(arguments)
    except (CalculatorError, ZeroDivisionError):
        return
    assert _number(result), (arguments, result)


def test_arguments_nested_past_the_recursion_limit_are_refused_by_name():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(CalculatorError, match=r"takes an expression string .*got \[+\.\.\.\]+$"):
        Calculator()({"expression": deep})
    # the parser or the evaluator reaches the recursion limit first (depending on the stack)
    for depth in (1500, 5000):
        with pytest.raises(CalculatorError, match="nested too deeply|not an arithmetic expression"):
            Calculator(max_length=10**6)("-" * depth + "1")


numbers = st.one_of(
    st.integers(0, 60), st.floats(0, 20, allow_nan=False).map(lambda x: round(x, 2))
)
trees = st.recursive(
    numbers.map(lambda v: ("num", v)),
    lambda inner: st.one_of(
        inner.map(lambda t: ("neg", t)),
        st.tuples(st.just("**"), inner, st.integers(0, 3)),
        st.tuples(st.sampled_from(sorted(set(OPS) - {"**"})), inner, inner),
    ),
    max_leaves=8,
)


@fuzz(200)
@given(tree=trees)
def test_well_formed_small_expressions_agree_with_python(tree):
    calc = Calculator(max_digits=200, max_exponent=3)
    text = expression_text(tree)
    try:
        value = expression_value(tree)
    except ZeroDivisionError:
        with pytest.raises(ZeroDivisionError):
            calc(text)
        return
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
        with pytest.raises(CalculatorError):
            calc(text)
        return
    assert calc(text) == format_number(value), text
