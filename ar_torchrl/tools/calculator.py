"""The ``calculator`` tool: a safe arithmetic evaluator over Python's ``ast`` (never ``eval``).

The expression is parsed with ``ast.parse(expression, mode="eval")`` and walked node by node: only
number literals (``int`` and ``float``; not ``bool``, not complex), the binary operators
``+ - * / // % **``, unary ``-`` and ``+`` and parentheses are evaluated; a name, a call, an
attribute, a subscript, a comparison or any other node is refused with a message that names it.
Sizes are bounded: the expression's length (``max_length``), every intermediate value's magnitude
(``< 10**max_digits``), and ``**``'s exponent (``|exponent| <= max_exponent``, and an integer power
is refused *before* it is computed when its result would exceed ``max_digits`` digits), so no call
can run long or build a huge number. Faults raise :class:`CalculatorError` (or Python's own
``ZeroDivisionError``) inside the tool, which :func:`~ar_torchrl.tools.base.run_tool` turns into an
error message for the model.

Results are normalised: integers (and floats with an integral value below
``10**significant_digits``) are written without ``.0``; other floats with ``significant_digits``
significant digits (``format(x, ".12g")``).
"""

from __future__ import annotations

import ast
import math
import operator
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ar_torchrl.tools.registry import register_tool
from ar_torchrl.utils.checks import check_number

__all__ = ["Calculator", "CalculatorConfig", "CalculatorError", "format_number"]

_BINARY: dict[type, tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_REFUSED = {
    ast.Name: "names are not allowed",
    ast.Call: "function calls are not allowed",
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "subscripts are not allowed",
    ast.Lambda: "lambdas are not allowed",
    ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "boolean operators are not allowed",
}


#: How refused arguments are shown (the model's JSON, any depth and size: cut, never a RecursionError).
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


class CalculatorError(ValueError):
    """The expression is not arithmetic the calculator evaluates, or its value is too large."""


def format_number(value: int | float, significant_digits: int = 12) -> str:
    """The normalised text of a result: integers without ``.0``, floats with
    ``significant_digits`` significant digits.

    Example:
        >>> format_number(408), format_number(6 / 3), format_number(1 / 3), format_number(-0.0)
        ('408', '2', '0.333333333333', '0')
        >>> format_number(2.5e20)
        '2.5e+20'
    """
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 10**significant_digits:
        return str(int(value))
    return f"{value:.{significant_digits}g}"


@dataclass(frozen=True)
class Calculator:
    """Evaluate an arithmetic expression: ``calculator("12*34") == "408"``.

    The argument is the expression string (the ``tag`` parser's argument) or a mapping
    ``{"expression": "..."}`` (a JSON call, the ``hermes`` parser's argument).

    Args:
        max_length: longest expression accepted, in characters.
        max_digits: every intermediate value must be ``< 10**max_digits`` in magnitude.
        max_exponent: largest ``|exponent|`` of ``**``.
        significant_digits: significant digits of a non-integral result.
        name: the tool's name (what the model writes in a call).

    Example:
        >>> calc = Calculator()
        >>> calc("12*34"), calc({"expression": "(7 + 5) / 8"}), calc("-2**3 % 5"), calc("7 // 2")
        ('408', '1.5', '2', '3')
        >>> calc("__import__('os')")
        Traceback (most recent call last):
        ...
        ar_torchrl.tools.calculator.CalculatorError: function calls are not allowed
        >>> calc("9**9**9")
        Traceback (most recent call last):
        ...
        ar_torchrl.tools.calculator.CalculatorError: 9**387420489: the exponent is larger than 100
    """

    max_length: int = 200
    max_digits: int = 100
    max_exponent: int = 100
    significant_digits: int = 12
    name: str = "calculator"

    @property
    def description(self) -> str:
        return (
            f"{self.name}(expression): evaluates an arithmetic expression such as 12*34 or "
            "(7+5)/4 (numbers, + - * / // % **, parentheses) and returns the number"
        )

    def __call__(self, arguments: Any) -> str:
        expression = self._expression(arguments)
        if len(expression) > self.max_length:
            raise CalculatorError(
                f"the expression has {len(expression)} characters, at most {self.max_length}"
            )
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
        try:
            value = self._eval(tree.body)
        except RecursionError:  # only with a max_length far above the default
            raise CalculatorError("the expression is nested too deeply") from None
        return format_number(value, self.significant_digits)

    def _expression(self, arguments: Any) -> str:
        if isinstance(arguments, Mapping) and set(arguments) == {"expression"}:
            arguments = arguments["expression"]
        if not isinstance(arguments, str):
            raise CalculatorError(
                f'{self.name} takes an expression string or {{"expression": "..."}}, got '
                f"{_REPR.repr(arguments)}"
            )
        return arguments

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CalculatorError(f"only numbers are allowed, got {value!r}")
            return self._bounded(value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            symbol, apply = _BINARY[type(node.op)]
            if symbol == "**":
                self._check_power(left, right)
            try:
                value = apply(left, right)
            except OverflowError:
                raise CalculatorError(f"{left}{symbol}{right}: the result is too large") from None
            return self._bounded(value)
        if isinstance(node, (ast.BinOp, ast.UnaryOp)):
            raise CalculatorError(f"the operator {type(node.op).__name__} is not allowed")
        reason = next((r for t, r in _REFUSED.items() if isinstance(node, t)), None)
        raise CalculatorError(reason or f"unsupported syntax: {type(node).__name__}")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if abs(exponent) > self.max_exponent:
            raise CalculatorError(
                f"{base}**{exponent}: the exponent is larger than {self.max_exponent}"
            )
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
            digits = exponent * math.log10(abs(base))
            if digits >= self.max_digits:
                raise CalculatorError(
                    f"{base}**{exponent} has about {digits:.0f} digits, at most {self.max_digits}"
                )

    def _bounded(self, value: Any) -> int | float:
        if isinstance(value, complex):
            raise CalculatorError("the result is a complex number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError(f"the result is not finite ({value})")
        if abs(value) >= 10**self.max_digits:
            raise CalculatorError(f"the result has more than {self.max_digits} digits")
        return value


@register_tool("calculator", help="safe arithmetic: numbers, + - * / // % **, parentheses")
@dataclass
class CalculatorConfig:
    """Options of :class:`Calculator` (``tools: [calculator]``; ``tool_options.calculator.*``).

    Example:
        >>> CalculatorConfig(max_digits=5).build()("999*999")
        Traceback (most recent call last):
        ...
        ar_torchrl.tools.calculator.CalculatorError: the result has more than 5 digits
        >>> CalculatorConfig(max_exponent=0).check("config: env.tool_options.calculator.")
        Traceback (most recent call last):
        ...
        ValueError: config: env.tool_options.calculator.max_exponent must be >= 1, got 0
    """

    max_length: int = 200  # longest expression, in characters
    max_digits: int = 100  # every intermediate value < 10**max_digits
    max_exponent: int = 100  # largest |exponent| of **
    significant_digits: int = 12  # of a non-integral result
    name: str = "calculator"  # what the model writes in a call

    def check(self, prefix: str) -> None:
        check_number(prefix, "max_length", self.max_length, ge=1, integer=True)
        check_number(prefix, "max_digits", self.max_digits, ge=1, le=4000, integer=True)
        check_number(prefix, "max_exponent", self.max_exponent, ge=1, integer=True)
        check_number(
            prefix, "significant_digits", self.significant_digits, ge=1, le=17, integer=True
        )
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"{prefix}name must be an identifier, got {self.name!r}")

    def build(self) -> Calculator:
        return Calculator(
            max_length=self.max_length,
            max_digits=self.max_digits,
            max_exponent=self.max_exponent,
            significant_digits=self.significant_digits,
            name=self.name,
        )
