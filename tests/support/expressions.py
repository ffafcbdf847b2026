"""Arithmetic expression trees for the calculator's tests: the text the model would write and the
value Python's own operators give (the obviously-correct twin)."""

from __future__ import annotations

import operator

OPS = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
    "**": operator.pow,
}


def expression_text(tree: tuple) -> str:
    """The expression of ``("num", v)``, ``("neg", t)``, ``("**", t, exponent)`` or
    ``(op, left, right)``, every operation in parentheses."""
    kind, *args = tree
    if kind == "num":
        return str(args[0])
    if kind == "neg":
        return f"-({expression_text(args[0])})"
    if kind == "**":
        return f"({expression_text(args[0])})**{args[1]}"
    return f"({expression_text(args[0])}) {kind} ({expression_text(args[1])})"


def expression_value(tree: tuple):
    """The twin: the tree computed by Python's own operators, node by node."""
    kind, *args = tree
    if kind == "num":
        return args[0]
    if kind == "neg":
        return -expression_value(args[0])
    if kind == "**":
        return expression_value(args[0]) ** args[1]
    return OPS[kind](expression_value(args[0]), expression_value(args[1]))
