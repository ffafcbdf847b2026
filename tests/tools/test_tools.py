"""Tools: every fault becomes a counted error result; the calculator against Python's arithmetic
(a loop twin over random expression trees) and its refusals; both call formats round-trip; the
config schema and the registries."""

from __future__ import annotations

import math
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from support.expressions import OPS, expression_text, expression_value

from ar_torchrl.tools import (
    COUNTERS,
    PARSERS,
    TOOLS,
    Calculator,
    CalculatorError,
    HermesParser,
    TagParser,
    Toolbox,
    ToolCall,
    ToolCallError,
    ToolConfig,
    ToolResult,
    format_number,
    run_tool,
)

# ----------------------------------------------------------------------------- test tools


@dataclass
class Echo:
    name: str = "echo"
    description: str = "echo(text): returns the text"

    def __call__(self, arguments):
        return arguments


@dataclass
class Boom:
    name: str = "boom"
    description: str = "boom(): raises"

    def __call__(self, arguments):
        raise RuntimeError(f"boom {arguments}")


@dataclass
class Blocking:
    """Waits until the test releases it (so the abandoned thread ends with the test)."""

    release: threading.Event
    name: str = "slow"
    description: str = "slow(): waits"

    def __call__(self, arguments):
        self.release.wait(10)
        return "late"


def tag(name: str, arguments: str) -> str:
    return f'<tool name="{name}">{arguments}</tool>'


# ----------------------------------------------------------------------------- faults


def test_each_fault_is_an_error_result_with_its_kind_and_message_and_is_counted():
    release = threading.Event()
    box = Toolbox(
        [Calculator(), Echo(), Boom(), Blocking(release)],
        TagParser(),
        timeout_s=0.2,
        max_output_chars=10,
    )
    cases = {
        "malformed": ('<tool name="calculator">12*34', r"not closed with </tool>\. The format is"),
        "unknown_tool": (
            tag("search", "cats"),
            r"^error: unknown tool 'search'; known tools: calculator, echo, boom, slow$",
        ),
        "raised": (tag("boom", "x"), r"^error: boom failed: RuntimeError: boom x$"),
        "timeout": (tag("slow", ""), r"^error: slow timed out after 0\.2 s$"),
        "oversized": (tag("echo", "y" * 25), r"^y{10}\.\.\. \[truncated: 15 more characters\]$"),
    }
    totals = dict.fromkeys(COUNTERS, 0)
    try:
        for kind, (text, message) in cases.items():
            turn = box.handle(text)
            (result,) = turn.results
            assert (result.ok, result.error) == (False, kind)
            assert re.search(message, result.content), (kind, result.content)
            assert not turn.ended and turn.counts["errors"] == 1 and turn.counts[kind] == 1
            totals = {k: totals[k] + v for k, v in turn.counts.items()}
    finally:
        release.set()  # the abandoned thread of the timeout ends now
    assert totals == {"calls": 5, "errors": 5, "dropped": 0, **dict.fromkeys(cases, 1)}
    ok = box.handle("First " + tag("calculator", "12*34") + " then wait.")
    assert ok.contents == ["408"] and ok.counts["errors"] == 0 and ok.counts["calls"] == 1
    assert ok.calls == [ToolCall("calculator", "12*34", tag("calculator", "12*34"))]


def test_calculator_errors_raise_inside_the_tool_and_become_raised_results():
    box = Toolbox([Calculator()], TagParser())
    for expression, message in [
        ("1/0", "ZeroDivisionError: division by zero"),
        ("x + 1", "CalculatorError: names are not allowed"),
        ("123456**30", "CalculatorError: 123456\\*\\*30 has about 153 digits, at most 100"),
        ("12 *", "CalculatorError: not an arithmetic expression: '12 \\*'"),
    ]:
        (result,) = box.handle(tag("calculator", expression)).results
        assert result.error == "raised"
        assert re.fullmatch(f"error: calculator failed: {message}", result.content), result.content


def test_no_call_ends_the_episode_and_extra_calls_are_dropped_and_counted():
    box = Toolbox([Calculator()], TagParser(), max_calls_per_turn=2)
    assert box.handle("The answer is 408.").ended
    assert box.handle("The answer is 408.").counts == dict.fromkeys(COUNTERS, 0)
    turn = box.handle(tag("calculator", "1+1") + tag("calculator", "2*3") + tag("calculator", "9"))
    assert turn.contents == ["2", "6"] and turn.dropped == 1 and turn.counts["dropped"] == 1
    assert turn.messages() == [{"role": "tool", "content": "2"}, {"role": "tool", "content": "6"}]
    # one malformed call among good ones: the whole turn is one malformed result
    bad = box.handle(tag("calculator", "1+1") + '<tool name="calculator">2')
    assert bad.calls == [] and [r.error for r in bad.results] == ["malformed"]


def test_a_tool_that_returns_no_string_and_the_result_invariants():
    result = run_tool(Echo(), ToolCall("echo", 5, ""), timeout_s=None, max_output_chars=8)
    assert result == ToolResult("error: echo returned int, expected a string", False, "raised")
    with pytest.raises(ValueError, match=r"ToolResult: ok=True with error='timeout'"):
        ToolResult("x", ok=True, error="timeout")
    with pytest.raises(ValueError, match=r"error='slow' is not one of \['malformed'"):
        ToolResult("x", ok=False, error="slow")


def test_toolbox_arguments_are_checked():
    with pytest.raises(ValueError, match=r"two tools are named \['echo'\]"):
        Toolbox([Echo(), Echo()], TagParser())
    with pytest.raises(ValueError, match=r"Toolbox: max_output_chars must be >= 1, got 0"):
        Toolbox([Echo()], TagParser(), max_output_chars=0)
    with pytest.raises(ValueError, match=r"Toolbox: timeout_s must be > 0, got -1"):
        Toolbox([Echo()], TagParser(), timeout_s=-1)


def test_hermes_malformed_calls():
    box = Toolbox([Calculator()], HermesParser())
    ok = box.handle(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    )
    assert ok.contents == ["42"]
    for text, message in [
        ("<tool_call>{not json}</tool_call>", "is not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'has no "name" string'),
        (
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
            'no "arguments" object',
        ),
        ('<tool_call>{"name": "calculator", "arguments": {}}', "not closed with </tool_call>"),
    ]:
        (result,) = box.handle(text).results
        assert result.error == "malformed" and message in result.content, result.content
    # a JSON string holding the arguments object is read as the object
    (call,) = HermesParser().parse(
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
    )
    assert call.arguments == {"expression": "1"}


def test_tag_parser_malformed_calls_and_what_is_not_a_call():
    parser = TagParser()
    assert parser.parse("a list of <tools> and <toolbox> is prose") == []
    for text, message in [
        ("<tool name=calculator>1</tool>", r"expected <tool name=\"NAME\">"),
        ("<tool>1</tool>", r"expected <tool name=\"NAME\">"),
        ('<tool name="no way">1</tool>', r"invalid tool name 'no way'"),
        ('<tool name="a"><tool name="b">1</tool></tool>', r"a call inside the call"),
    ]:
        with pytest.raises(ToolCallError, match=message):
            parser.parse(text)
    with pytest.raises(ValueError, match=r"arguments must be a string without <tool or </tool>"):
        parser.format(ToolCall("echo", "a</tool>b", ""))


# ----------------------------------------------------------------------------- hostile model turns


_TOO_LONG = "9" * 5000


def _nested(expression_json: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": {expression_json}}}}}</tool_call>'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "<tool_call>" + "[" * 1000 + "</tool_call>",
            r"not valid JSON \(brackets nested too deeply\)",
        ),
        (
            "<tool_call>" + '{"a": ' * 1000 + "</tool_call>",
            r"not valid JSON \(brackets nested too deeply\)",
        ),
        (
            _nested("[" * 1000 + "1" + "]" * 1000),
            r"not valid JSON \(brackets nested too deeply\)",
        ),
        (
            _nested(_TOO_LONG),
            r"not valid JSON \(ValueError: Exceeds the limit \(4300 digits\) for integer string "
            r"conversion: value has 5000 digits\)",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": "' + "[" * 1000 + '"}</tool_call>',
            r'the call has no "arguments" object',
        ),
    ],
)
def test_hermes_turns_that_break_the_json_reader_are_malformed_calls(text, message):
    """Issue 29 N1: ~1000 nested brackets (a few hundred BPE tokens) raised RecursionError out of
    Toolbox.handle, a 5000-digit integer a ValueError; both ended ToolEnv.collect()."""
    box = Toolbox([Calculator()], HermesParser())
    turn = box.handle("Let me compute. " + text)
    (result,) = turn.results
    assert result.error == "malformed" and turn.counts["malformed"] == 1 and not turn.ended
    assert re.search(r"^error: malformed tool call: .*" + message, result.content), result.content
    with pytest.raises(ToolCallError, match=message):
        HermesParser().parse(text)


class _Fragile:
    """A parser that lets the model's text break it (it should raise ToolCallError)."""

    name, syntax = "fragile", "<call>"

    def parse(self, text):
        raise RecursionError("maximum recursion depth exceeded")

    def format(self, call):
        return "<call>"


def test_a_parser_that_raises_anything_gives_a_malformed_result(caplog):
    turn = Toolbox([Calculator()], _Fragile()).handle("anything")
    (result,) = turn.results
    assert result.error == "malformed" and result.content == (
        "error: malformed tool call: RecursionError: maximum recursion depth exceeded. The "
        "format is <call>"
    )
    assert "the 'fragile' parser raised RecursionError" in caplog.text


class _Custom(BaseException):
    pass


@dataclass
class Raiser:
    error: BaseException
    name: str = "raiser"
    description: str = "raiser(): raises what it is given"

    def __call__(self, arguments):
        raise self.error


@pytest.mark.parametrize("timeout_s", [5.0, None])
@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (SystemExit(3), "SystemExit: 3"),
        (KeyboardInterrupt(), "KeyboardInterrupt"),
        (GeneratorExit("closed"), "GeneratorExit: closed"),
        (_Custom("mine"), "_Custom: mine"),
    ],
)
def test_a_tool_raising_a_base_exception_is_a_raised_result_not_a_timeout(error, shown, timeout_s):
    """Issue 29 N3: SystemExit/KeyboardInterrupt from a tool were reported as a 5 s timeout, and
    with timeout_s=None they ended the run."""
    box = Toolbox([Raiser(error)], TagParser(), timeout_s=timeout_s)
    start = time.monotonic()
    turn = box.handle(tag("raiser", "x"))
    assert time.monotonic() - start < 2  # not the deadline
    assert turn.results == [ToolResult(f"error: raiser failed: {shown}", False, "raised")]
    assert turn.counts["raised"] == 1 and turn.counts["timeout"] == 0


@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_a_signal_to_the_process_still_stops_the_run_during_a_tool_call(timeout_s):
    """A SIGTERM (or Ctrl-C) to the trainer while a tool runs: the recipe's handler raises
    KeyboardInterrupt in the main thread, which waits for the tool, and it comes through."""
    from ar_torchrl.recipes.launch import StopOnSignal

    release = threading.Event()
    box = Toolbox([Blocking(release)], TagParser(), timeout_s=timeout_s)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
    start = time.monotonic()
    try:
        with StopOnSignal() as stop:  # not graceful yet: the signal stops at once
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                box.handle(tag("slow", ""))
    finally:
        timer.cancel()
        release.set()
    assert stop.name == "SIGTERM" and time.monotonic() - start < 5


def test_a_graceful_signal_lets_the_tool_call_finish():
    """With the loop running (graceful), the first signal only asks to stop after the iteration:
    the wait for the tool goes on and its answer comes back."""
    from ar_torchrl.recipes.launch import StopOnSignal

    release = threading.Event()
    box = Toolbox([Blocking(release)], TagParser(), timeout_s=None)
    signal_then_release = threading.Timer(
        0.1, lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.2), release.set())
    )
    try:
        with StopOnSignal() as stop:
            stop.graceful = True
            signal_then_release.start()
            turn = box.handle(tag("slow", ""))
    finally:
        signal_then_release.cancel()
        release.set()
    assert turn.contents == ["late"] and stop.requested and stop.name == "SIGTERM"


# ----------------------------------------------------------------------------- round trips


def _random_text(rng: random.Random, n: int) -> str:
    alphabet = "abcXYZ 0123456789+-*/()<>\"'\n{}[]:,.éß€\\"
    return "".join(rng.choice(alphabet) for _ in range(n))


def test_both_parsers_round_trip_random_calls():
    rng = random.Random(0)
    tag_parser, hermes = TagParser(), HermesParser()
    for _ in range(300):
        name = rng.choice("abcxyz_") + "".join(
            rng.choice("abc09_.-") for _ in range(rng.randrange(8))
        )
        text = _random_text(rng, rng.randrange(30))
        if "<tool" in text or "</tool>" in text:
            continue
        call = ToolCall(name, text, "")
        written = tag_parser.format(call)
        assert tag_parser.parse(written) == [replace(call, text=written)]
        arguments = {
            "expression": text,
            "n": rng.randrange(-100, 100),
            "x": rng.random(),
            "nested": [text[:3], {"k": None, "b": True}],
        }
        call = ToolCall(name, arguments, "")
        written = hermes.format(call)
        assert hermes.parse(written) == [replace(call, text=written)]
    # calls inside prose, several per text, in order
    calls = [ToolCall("calculator", "1+2", ""), ToolCall("echo", "hi", "")]
    for parser, args in ((tag_parser, ["1+2", "hi"]), (hermes, [{"e": "1+2"}, {"t": "hi"}])):
        calls = [ToolCall(c.name, a, "") for c, a in zip(calls, args)]
        pieces = [parser.format(c) for c in calls]
        text = f"Let me see. {pieces[0]} and then\n{pieces[1]}\nDone."
        assert parser.parse(text) == [replace(c, text=p) for c, p in zip(calls, pieces)]


# ----------------------------------------------------------------------------- the calculator


def _random_tree(rng: random.Random, depth: int) -> tuple:
    """A random expression tree: ("num", v), ("neg", t), ("**", t, exponent) or (op, left, right)."""
    if depth == 0 or rng.random() < 0.3:
        return ("num", rng.randrange(0, 60) if rng.random() < 0.8 else round(rng.uniform(0, 20), 2))
    if rng.random() < 0.15:
        return ("neg", _random_tree(rng, depth - 1))
    symbol = rng.choice(list(OPS))
    if symbol == "**":  # small integer exponents keep the numbers small and real
        return ("**", _random_tree(rng, depth - 1), rng.randrange(0, 4))
    return (symbol, _random_tree(rng, depth - 1), _random_tree(rng, depth - 1))


def test_calculator_matches_python_arithmetic_on_random_expressions():
    rng = random.Random(1)
    calc = Calculator(max_digits=200, max_exponent=3)
    checked = zero_divisions = 0
    for _ in range(2000):
        tree = _random_tree(rng, 4)
        try:
            value = expression_value(tree)
        except ZeroDivisionError:
            with pytest.raises(ZeroDivisionError):
                calc(expression_text(tree))
            zero_divisions += 1
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        assert calc(expression_text(tree)) == format_number(value), expression_text(tree)
        checked += 1
    assert checked > 1500 and zero_divisions > 10


def test_calculator_precedence_and_normalisation_against_python():
    calc = Calculator()
    cases = {
        "-2**2": -(2**2),
        "2**3**2": 2**3**2,
        "7-3-2": 7 - 3 - 2,
        "2*3+4*5": 2 * 3 + 4 * 5,
        "-3//2": -3 // 2,
        "-7 % 3": -7 % 3,
        "10/4": 10 / 4,
        "6/3": 6 / 3,
        "+5 - -5": +5 - -5,
        " ( 1 + 2 ) * 3 ": (1 + 2) * 3,
        "2**-2": 2**-2,
        "1_000 * 3": 1_000 * 3,
        "0.1 + 0.2": 0.1 + 0.2,
    }
    for text, value in cases.items():
        assert calc(text) == format_number(value), text
    assert [calc("6/3"), calc("10/4"), calc("1/3"), calc("0.1 + 0.2")] == [
        "2",
        "2.5",
        "0.333333333333",
        "0.3",
    ]


@pytest.mark.parametrize(
    "expression, message",
    [
        ("x", "names are not allowed"),
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("abs(-1)", "function calls are not allowed"),
        ("(1).real", "attribute access is not allowed"),
        ("(2).__class__", "attribute access is not allowed"),
        ("[1, 2][0]", "subscripts are not allowed"),
        ("lambda: 1", "lambdas are not allowed"),
        ("1 < 2", "comparisons are not allowed"),
        ("1 and 2", "boolean operators are not allowed"),
        ("True + 1", "only numbers are allowed, got True"),
        ("'a' * 3", "only numbers are allowed, got 'a'"),
        ("1j * 1j", "only numbers are allowed, got 1j"),
        ("1 << 100", "the operator LShift is not allowed"),
        ("~1", "the operator Invert is not allowed"),
        ("{1: 2}", "unsupported syntax: Dict"),
        ("9**9**9", r"9\*\*387420489: the exponent is larger than 100"),
        ("10**101", r"the exponent is larger than 100"),
        ("123456**30", r"123456\*\*30 has about 153 digits, at most 100"),
        ("99999999999**50", r"has about 550 digits"),
        ("(10**50) * (10**50)", "the result has more than 100 digits"),
        ("1e101", "the result has more than 100 digits"),
        ("(-8) ** 0.5", "the result is a complex number"),
        ("1" * 201, "the expression has 201 characters, at most 200"),
        ("(" * 150 + "1" + ")" * 150, "the expression has 301 characters"),
        ("12 +* 3", "not an arithmetic expression"),
        ("import os", "not an arithmetic expression"),
    ],
)
def test_calculator_refuses(expression, message):
    with pytest.raises(CalculatorError, match=message):
        Calculator()(expression)


def test_calculator_arguments_and_limits():
    calc = Calculator()
    assert calc({"expression": "2*21"}) == "42"
    with pytest.raises(
        CalculatorError, match=r'calculator takes an expression string or \{"expression"'
    ):
        calc({"expr": "1"})
    with pytest.raises(ZeroDivisionError):
        calc("0.0 ** -1")
    with pytest.raises(CalculatorError, match=r"the result is not finite \(inf\)"):
        Calculator(max_digits=400)("1e308 * 10")
    assert Calculator(max_length=1000)("(" * 90 + "1" + ")" * 90) == "1"


def test_the_tools_package_never_evaluates_model_text():
    sources = Path(__file__).parents[2].joinpath("ar_torchrl", "tools").glob("*.py")
    for path in sources:
        code = path.read_text()
        assert not re.search(r"(?<![\w.])(eval|exec|compile)\(", code), path


# ----------------------------------------------------------------------------- config and registries


def test_registries_and_the_config_schema():
    assert TOOLS.names() == ("calculator",) and PARSERS.names() == ("tag", "hermes")
    cfg = ToolConfig(
        tools=["calculator"],
        tool_parser="hermes",
        timeout_s=None,
        tool_options={"calculator": {"max_digits": 10, "name": "calc"}},
    )
    cfg.check("config: env.")
    box = cfg.build()
    assert box.names == ("calc",) and isinstance(box.parser, HermesParser) and box.timeout_s is None
    call = box.format_call("calc", {"expression": "10**9 * 10"})
    assert box.handle(call).contents == [
        "error: calc failed: CalculatorError: the result has more than 10 digits"
    ]
    assert "calc(expression)" in box.description and HermesParser.syntax in box.description


@pytest.mark.parametrize(
    "values, error, message",
    [
        ({"tools": []}, ValueError, r"config: env\.tools must be a non-empty list of tool names"),
        (
            {"tools": ["calculater"]},
            ValueError,
            r"unknown tool 'calculater' \(did you mean 'calculator'\?\)",
        ),
        ({"tools": ["calculator", "calculator"]}, ValueError, r"lists a tool twice"),
        (
            {"tool_parser": "hermez"},
            ValueError,
            r"tool_parser: unknown tool call parser 'hermez' \(did you mean 'hermes'\?\)",
        ),
        (
            {"timeout_s": 0},
            ValueError,
            r"config: env\.timeout_s must be > 0, got 0 \(None: no deadline\)",
        ),
        ({"max_output_chars": 1.5}, TypeError, r"config: env\.max_output_chars must be an integer"),
        (
            {"tool_options": {"echo": {}}},
            ValueError,
            r"tool_options\.echo: 'echo' is not in config: env\.tools",
        ),
        (
            {"tool_options": {"calculator": {"max_digit": 3}}},
            ValueError,
            r"config: env\.tool_options\.calculator\.max_digit: tool 'calculator' has no option 'max_digit' \(did you mean 'max_digits'\?\)",
        ),
        (
            {"tool_options": {"calculator": {"max_digits": 0}}},
            ValueError,
            r"config: env\.tool_options\.calculator\.max_digits must be >= 1 and <= 4000, got 0",
        ),
    ],
)
def test_config_errors_name_the_key(values, error, message):
    with pytest.raises(error, match=message):
        ToolConfig(**values).check("config: env.")


def test_tools_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys, ar_torchrl.tools as t; t.ToolConfig().build(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
