"""Generated verifiable tasks for pretrained chat models: arithmetic with one-shot chat examples.

A small instruct model (SmolLM2-135M-Instruct) ignores a written instruction to end with an
``Answer:`` line (0 % format rate with DAPO's prompt or the short one), but copies the format of an
earlier chat turn: each row's prompt is ``shots`` solved examples as user/assistant turns, then the
question::

    [{"role": "user", "content": "What is 3 + 8?"}, {"role": "assistant", "content": "Answer: 11"},
     {"role": "user", "content": "What is 6 + 1?"}]

The rows are in the DAPO-Math schema (see :mod:`ar_torchrl.data.datasets`), so the DAPO reward
(+1/-1 on the last ``Answer:`` line) scores them unchanged. :func:`arithmetic_task_split` splits the
*problems* (operand pairs), not the rows, so no held-out question is ever seen in training, with any
shot around it.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ar_torchrl.data.datasets import MathDataset, check_generated_rows
from ar_torchrl.data.registry import register_task
from ar_torchrl.utils.checks import check_number

__all__ = [
    "COLUMN_TEMPLATE",
    "OPS",
    "arithmetic_task_split",
    "column_problems",
    "column_trace",
    "count_carries",
    "critic_arithmetic_rows",
    "critic_arithmetic_split",
    "fewshot_rows",
    "mixed_arithmetic_split",
    "parse_level",
    "problem_space",
]

Op = Literal["+", "-", "*"]
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
Problem = tuple[int, Op, int]


def problem_space(ops: Sequence[Op], min_operand: int, max_operand: int) -> list[Problem]:
    """Every ``(a, op, b)`` with both operands in ``[min_operand, max_operand]``, in a fixed order.

    Example:
        >>> len(problem_space(["+", "*"], 0, 9)), problem_space(["+"], 1, 2)
        (200, [(1, '+', 1), (1, '+', 2), (2, '+', 1), (2, '+', 2)])
    """
    unknown = sorted(set(ops) - set(OPS))
    if unknown or not ops:
        raise ValueError(f"problem_space: ops must be a non-empty subset of {list(OPS)}, got {ops}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(
            f"problem_space: need 0 <= min_operand <= max_operand, got {min_operand}, {max_operand}"
        )
    span = range(min_operand, max_operand + 1)
    return [(a, op, b) for op in ops for a in span for b in span]


def _question(problem: Problem) -> str:
    a, op, b = problem
    return f"What is {a} {op} {b}?"


def _answer(problem: Problem) -> str:
    a, op, b = problem
    return str(OPS[op](a, b))


def fewshot_rows(
    problems: Sequence[Problem],
    shot_pool: Sequence[Problem],
    *,
    shots: int = 1,
    seed: int = 0,
    data_source: str = "fewshot_arithmetic",
) -> list[dict]:
    """One DAPO-schema row per problem, its prompt led by ``shots`` solved examples from ``shot_pool``.

    The examples are drawn (seeded) from ``shot_pool`` and never equal the row's own problem.

    Example:
        >>> rows = fewshot_rows([(6, "+", 1)], [(3, "+", 8), (6, "+", 1)], shots=1)
        >>> [m["content"] for m in rows[0]["prompt"]], rows[0]["reward_model"]["ground_truth"]
        (['What is 3 + 8?', 'Answer: 11', 'What is 6 + 1?'], '7')
    """
    if shots < 0:
        raise ValueError(f"fewshot_rows: shots must be >= 0, got {shots}")
    rng = random.Random(seed)
    rows = []
    for i, problem in enumerate(problems):
        pool = [p for p in shot_pool if p != problem]
        if len(pool) < shots:
            raise ValueError(
                f"fewshot_rows: shot_pool has {len(pool)} problems other than {problem}, "
                f"need shots={shots}"
            )
        messages = []
        for shot in rng.sample(pool, shots):
            messages += [
                {"role": "user", "content": _question(shot)},
                {"role": "assistant", "content": f"Answer: {_answer(shot)}"},
            ]
        messages.append({"role": "user", "content": _question(problem)})
        rows.append(
            {
                "data_source": data_source,
                "prompt": messages,
                "ability": "MATH",
                "reward_model": {"ground_truth": _answer(problem), "style": "rule"},
                "extra_info": {"index": i, "problem": " ".join(map(str, problem))},
            }
        )
    return rows


def arithmetic_task_split(
    num_rows: int,
    holdout: int,
    *,
    ops: Sequence[Op] = ("+",),
    min_operand: int = 0,
    max_operand: int = 9,
    shots: int = 1,
    seed: int = 0,
) -> tuple[MathDataset, MathDataset]:
    """Training and held-out one-shot arithmetic rows over *disjoint problems*.

    The problem space (:func:`problem_space`) is shuffled with ``seed``; the first ``holdout``
    problems are the evaluation rows (one row each), the rest are sampled with replacement into
    ``num_rows`` training rows. Shots are drawn from the training problems only.

    Args:
        num_rows: training rows.
        holdout: held-out problems (= evaluation rows).
        ops: operations to draw from.
        min_operand: smallest operand.
        max_operand: largest operand.
        shots: solved examples before each question.
        seed: shuffle / sampling seed.

    Returns:
        ``(train, holdout)`` datasets.

    Example:
        >>> train, test = arithmetic_task_split(50, 10, max_operand=9, seed=0)
        >>> len(train), len(test)
        (50, 10)
        >>> {r["extra_info"]["problem"] for r in train}.isdisjoint(
        ...     r["extra_info"]["problem"] for r in test)
        True
    """
    space = problem_space(ops, min_operand, max_operand)
    if not 0 < holdout < len(space) or num_rows < 1:
        raise ValueError(
            f"arithmetic_task_split: holdout={holdout} must be in (0, {len(space)}) (the number of "
            f"distinct problems) and num_rows={num_rows} >= 1"
        )
    rng = random.Random(seed)
    rng.shuffle(space)
    test_problems, train_problems = space[:holdout], space[holdout:]
    train_draw = [rng.choice(train_problems) for _ in range(num_rows)]
    train = fewshot_rows(train_draw, train_problems, shots=shots, seed=seed + 1)
    test = fewshot_rows(test_problems, train_problems, shots=shots, seed=seed + 2)
    return MathDataset(train, name="train"), MathDataset(test, name="holdout")


@register_task(
    "fewshot_arithmetic",
    help="one-shot chat arithmetic for pretrained chat models (disjoint split)",
)
@dataclass
class FewshotArithmeticDataConfig:
    """``data=fewshot_arithmetic``: :func:`arithmetic_task_split` rows (train and held-out rows over
    disjoint problems)."""

    num_rows: int = 4000  # training rows (drawn with replacement from the training problems)
    ops: list[str] = field(default_factory=lambda: ["+"])  # any of +, -, *
    min_operand: int = 0  # smallest operand
    max_operand: int = 9  # largest operand
    shots: int = 1  # solved user/assistant turns before the question
    holdout: int = 64  # held-out problems (one evaluation row each)
    seed: int = 0  # problem split / sampling seed

    def check(self, prefix: str) -> None:
        check_generated_rows(prefix, self.num_rows)
        key = prefix.rsplit(" ", 1)[-1]
        if not self.ops or any(op not in ("+", "-", "*") for op in self.ops):
            raise ValueError(f"{prefix}ops must be a non-empty list of +, -, *; got {self.ops}")
        check_number(prefix, "min_operand", self.min_operand, ge=0, integer=True)
        check_number(prefix, "max_operand", self.max_operand, ge=self.min_operand, integer=True)
        check_number(prefix, "shots", self.shots, ge=0, integer=True)
        check_number(prefix, "holdout", self.holdout, ge=1, integer=True)
        problems = len(set(self.ops)) * (self.max_operand - self.min_operand + 1) ** 2
        if self.holdout >= problems:
            raise ValueError(
                f"{prefix}holdout={self.holdout} must be < {problems}, the number of distinct "
                f"problems of {key}ops={self.ops} with operands in [{key}min_operand, "
                f"{key}max_operand] (the rest are the training problems)"
            )

    def build(self) -> tuple[MathDataset, MathDataset]:
        return arithmetic_task_split(
            self.num_rows,
            self.holdout,
            ops=list(self.ops),
            min_operand=self.min_operand,
            max_operand=self.max_operand,
            shots=self.shots,
            seed=self.seed,
        )


# --------------------------------------------------------------------------- mixed difficulty
Level = tuple[Op, int, int]


def parse_level(level: str) -> Level:
    """``"OP LOW-HIGH"`` (e.g. ``"* 10-99"``: products of two operands in ``[10, 99]``) ->
    ``(op, low, high)``.

    Example:
        >>> parse_level("* 10-99"), parse_level("+ 0-9")
        (('*', 10, 99), ('+', 0, 9))
    """
    op, _, span = str(level).strip().partition(" ")
    low, _, high = span.strip().partition("-")
    if op not in OPS or not low.isdigit() or not high.isdigit() or int(low) > int(high):
        raise ValueError(
            f"level {level!r} must read 'OP LOW-HIGH' with OP one of {list(OPS)} and integers "
            "0 <= LOW <= HIGH, e.g. '+ 0-9' or '* 10-99'"
        )
    return op, int(low), int(high)  # type: ignore[return-value]


def _level_holdout(levels: Sequence[str], holdout: int) -> list[int]:
    """Held-out problems per level: ``holdout`` spread evenly (the first levels take the rest)."""
    return [holdout // len(levels) + (i < holdout % len(levels)) for i in range(len(levels))]


def mixed_arithmetic_split(
    num_rows: int,
    holdout: int,
    *,
    levels: Sequence[str] = ("+ 0-9", "* 0-9", "+ 10-99"),
    shots: int = 3,
    seed: int = 0,
) -> tuple[MathDataset, MathDataset]:
    """Few-shot chat arithmetic whose difficulty varies by prompt: one problem family per level.

    Each training row draws a level uniformly, then a problem of that level's training problems
    (with replacement); its ``shots`` solved examples are other training problems of the *same*
    level (the answer's size is part of the format copied). Each level's problem space
    (:func:`problem_space`) is split as :func:`arithmetic_task_split` splits one: the held-out
    problems, spread evenly over the levels, are never trained on, not even as a shot. Rows carry
    ``extra_info["level"]`` (``benchmarks/critic_ceiling.py --group-by level``).

    Args:
        num_rows: training rows.
        holdout: held-out problems (= evaluation rows), at most half of each level's problems.
        levels: ``"OP LOW-HIGH"`` strings (:func:`parse_level`).
        shots: solved examples before each question.
        seed: split / sampling seed.

    Example:
        >>> train, test = mixed_arithmetic_split(60, 4, levels=["+ 0-9", "* 10-99"], shots=1)
        >>> len(train), [r["extra_info"]["level"] for r in test]
        (60, ['+ 0-9', '+ 0-9', '* 10-99', '* 10-99'])
        >>> [m["content"] for m in test[2]["prompt"]]  # the shot: a product of the same level
        ['What is 73 * 38?', 'Answer: 2774', 'What is 34 * 15?']
    """
    parsed = [parse_level(level) for level in levels]
    if not parsed or len(set(parsed)) != len(parsed):
        raise ValueError(f"mixed_arithmetic_split: levels must be distinct and non-empty: {levels}")
    if num_rows < 1 or shots < 0:
        raise ValueError(
            f"mixed_arithmetic_split: need num_rows >= 1 and shots >= 0, got {num_rows}, {shots}"
        )
    rng = random.Random(seed)
    train_pools, held = [], []
    for level, (op, low, high), share in zip(levels, parsed, _level_holdout(levels, holdout)):
        space = problem_space([op], low, high)
        if holdout < 1 or 2 * share > len(space) or len(space) - share <= shots:
            raise ValueError(
                f"mixed_arithmetic_split: holdout={holdout} must be >= 1 and leave at least half of "
                f"the {len(space)} problems of level {level!r} (and more than shots={shots}) to "
                f"training ({share} held out)"
            )
        rng.shuffle(space)
        held += [(level, p) for p in space[:share]]
        train_pools.append(space[share:])
    draw = []
    for _ in range(num_rows):
        i = rng.randrange(len(levels))
        draw.append((levels[i], rng.choice(train_pools[i])))
    pool_of = dict(zip(levels, train_pools))
    train = _mixed_rows(draw, pool_of, shots, random.Random(seed + 1))
    test = _mixed_rows(held, pool_of, shots, random.Random(seed + 2))
    return MathDataset(train, name="train"), MathDataset(test, name="holdout")


def _mixed_rows(
    problems: Sequence[tuple[str, Problem]],
    pools: dict[str, list[Problem]],
    shots: int,
    rng: random.Random,
) -> list[dict]:
    """:func:`fewshot_rows`' rows, each problem's shots drawn from its level's pool (redrawn
    while they hold the problem itself: the pools are large, filtering them per row is not)."""
    rows = []
    for i, (level, problem) in enumerate(problems):
        chosen = rng.sample(pools[level], shots)
        while problem in chosen:
            chosen = rng.sample(pools[level], shots)
        row = fewshot_rows([problem], chosen, shots=shots, data_source="fewshot_arithmetic_mixed")
        row[0]["extra_info"].update(index=i, level=level)
        rows.append(row[0])
    return rows


@register_task(
    "fewshot_arithmetic_mixed",
    help="few-shot chat arithmetic mixing easy and hard problem families (value is learnable)",
)
@dataclass
class MixedArithmeticDataConfig:
    """``data=fewshot_arithmetic_mixed``: :func:`mixed_arithmetic_split` rows (train and held-out
    rows over disjoint problems, difficulty varying by prompt)."""

    num_rows: int = 4000  # training rows (a level drawn uniformly, then one of its problems)
    levels: list[str] = field(default_factory=lambda: ["+ 0-9", "* 0-9", "+ 10-99"])
    shots: int = 3  # solved user/assistant turns of the same level before the question
    holdout: int = 64  # held-out problems, spread evenly over the levels
    seed: int = 0  # problem split / sampling seed

    def check(self, prefix: str) -> None:
        check_generated_rows(prefix, self.num_rows)
        key = prefix.rsplit(" ", 1)[-1]
        for level in self.levels:
            try:
                parse_level(level)
            except ValueError as err:
                raise ValueError(f"{prefix}levels: {err}") from None
        if not self.levels or len({parse_level(v) for v in self.levels}) != len(self.levels):
            raise ValueError(f"{prefix}levels must be distinct and non-empty, got {self.levels}")
        check_number(prefix, "shots", self.shots, ge=0, integer=True)
        check_number(prefix, "holdout", self.holdout, ge=1, integer=True)
        for level, share in zip(self.levels, _level_holdout(self.levels, self.holdout)):
            op, low, high = parse_level(level)
            problems = (high - low + 1) ** 2
            if 2 * share > problems or problems - share <= self.shots:
                raise ValueError(
                    f"{prefix}holdout={self.holdout} holds out {share} of the {problems} problems "
                    f"of level {level!r}: at most half (and fewer than all but {key}shots) may be"
                )

    def build(self) -> tuple[MathDataset, MathDataset]:
        return mixed_arithmetic_split(
            self.num_rows, self.holdout, levels=list(self.levels), shots=self.shots, seed=self.seed
        )


# --------------------------------------------------------------------------- tool arithmetic
#: The prompt of the tool task, in the call format of the ``tag`` parser
#: (:class:`ar_torchrl.tools.TagParser`).
TOOL_TEMPLATE = (
    'Compute {a} * {b}. Calculator: <tool name="calculator">expression</tool>. '
    "End with Answer: $Answer"
)


def tool_problems(num: int, *, digits: int = 2, seed: int = 0) -> list[tuple[int, int]]:
    """``num`` multiplications of two ``digits``-digit numbers (seeded, with repetition).

    Example:
        >>> tool_problems(2, digits=2, seed=0)
        [(59, 63), (15, 43)]
    """
    if digits < 1 or num < 1:
        raise ValueError(f"tool_problems: need digits >= 1 and num >= 1, got {digits}, {num}")
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    return [(rng.randint(low, high), rng.randint(low, high)) for _ in range(num)]


def tool_shot(a: int, b: int) -> list[dict]:
    """One solved tool-use exchange as chat messages: the question, the assistant's calculator
    call, the tool's answer (role ``"tool"``) and the assistant's final answer.

    Example:
        >>> [m["role"] for m in tool_shot(12, 34)], tool_shot(12, 34)[1]["content"]
        (['user', 'assistant', 'tool', 'assistant'], '<tool name="calculator">12*34</tool>')
    """
    return [
        {"role": "user", "content": TOOL_TEMPLATE.format(a=a, b=b)},
        {"role": "assistant", "content": f'<tool name="calculator">{a}*{b}</tool>'},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"Answer: {a * b}"},
    ]


def tool_arithmetic_rows(
    num_rows: int,
    *,
    digits: int = 2,
    seed: int = 0,
    problems: Sequence[tuple[int, int]] | None = None,
    shots: int = 0,
    shot_pool: Sequence[tuple[int, int]] | None = None,
) -> MathDataset:
    """Rows of the tool task: multiply two multi-digit numbers (a tiny model cannot in its head,
    with the calculator it can). DAPO's schema, plus ``extra_info.problem`` (``"37 * 58"``).

    ``shots`` solved exchanges (:func:`tool_shot`, drawn seeded from ``shot_pool``, never the row's
    own problem) lead the prompt: a pretrained chat model copies the call format from them (as
    ``fewshot_arithmetic`` does for plain answers).

    Example:
        >>> rows = tool_arithmetic_rows(2, seed=0)
        >>> rows.messages(0)[0]["content"][:16], rows.ground_truth(0), rows[0]["extra_info"]["problem"]
        ('Compute 59 * 63.', '3717', '59 * 63')
        >>> shot = tool_arithmetic_rows(1, problems=[(59, 63)], shots=1, shot_pool=[(12, 34)])
        >>> [m["role"] for m in shot.messages(0)]
        ['user', 'assistant', 'tool', 'assistant', 'user']
    """
    pairs = (
        list(problems)
        if problems is not None
        else tool_problems(num_rows, digits=digits, seed=seed)
    )
    if shots < 0:
        raise ValueError(f"tool_arithmetic_rows: shots must be >= 0, got {shots}")
    rng = random.Random(seed + 1)
    rows = []
    for i, (a, b) in enumerate(pairs):
        messages: list[dict] = []
        if shots:
            pool = [p for p in (shot_pool or pairs) if p != (a, b)]
            if len(pool) < shots:
                raise ValueError(
                    f"tool_arithmetic_rows: the shot pool has {len(pool)} problems other than "
                    f"{a} * {b}, need shots={shots}"
                )
            for x, y in rng.sample(pool, shots):
                messages += tool_shot(x, y)
        messages.append({"role": "user", "content": TOOL_TEMPLATE.format(a=a, b=b)})
        rows.append(
            {
                "data_source": "tool_arithmetic",
                "prompt": messages,
                "ability": "MATH",
                "reward_model": {"ground_truth": str(a * b), "style": "rule"},
                "extra_info": {"index": i, "problem": f"{a} * {b}"},
            }
        )
    return MathDataset(rows, name="tool_arithmetic")


@register_task(
    "tool_arithmetic", help="multi-digit multiplication a tiny model needs a calculator for"
)
@dataclass
class ToolArithmeticDataConfig:
    """``data=tool_arithmetic``: :func:`tool_arithmetic_rows`; the held-out problems are disjoint
    from the training ones."""

    num_rows: int = 2000  # training rows
    digits: int = 2  # digits of each operand
    holdout: int = 64  # held-out problems (one evaluation row each)
    seed: int = 0  # problem seed
    shots: int = 0  # solved tool-use exchanges before the question (pretrained chat models)

    def check(self, prefix: str) -> None:
        check_generated_rows(prefix, self.num_rows)
        check_number(prefix, "shots", self.shots, ge=0, le=8, integer=True)
        check_number(prefix, "digits", self.digits, ge=1, le=6, integer=True)
        check_number(prefix, "holdout", self.holdout, ge=1, integer=True)
        space = (9 * 10 ** (self.digits - 1)) ** 2
        if self.holdout >= space:
            raise ValueError(f"{prefix}holdout={self.holdout} must be < {space} distinct problems")

    def build(self) -> tuple[MathDataset, MathDataset]:
        rng = random.Random(self.seed)
        held: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        while len(held) < self.holdout:
            pair = (rng.randint(low, high), rng.randint(low, high))
            if pair not in seen:
                seen.add(pair)
                held.append(pair)
        train: list[tuple[int, int]] = []
        while len(train) < self.num_rows:
            pair = (rng.randint(low, high), rng.randint(low, high))
            if pair not in seen:
                train.append(pair)
        return (  # shots come from the training problems only
            tool_arithmetic_rows(
                len(train), problems=train, shots=self.shots, shot_pool=train, seed=self.seed
            ),
            tool_arithmetic_rows(
                len(held), problems=held, shots=self.shots, shot_pool=train, seed=self.seed + 7
            ),
        )


# --------------------------------------------------------------------------- critic arithmetic
#: The prompt of the column-addition task: the bare problem (a tiny model reads no instruction;
#: the warm start teaches the response format, and a short prompt keeps CPU updates cheap).
COLUMN_TEMPLATE = "{a} + {b}"


def _operand_range(digits: int) -> tuple[int, int]:
    """Operands with exactly ``digits`` digits (``0..9`` for one digit)."""
    return (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)


def count_carries(a: int, b: int) -> int:
    """How many columns of ``a + b`` carry into the next one.

    Example:
        >>> count_carries(57, 38), count_carries(12, 34), count_carries(999, 1)
        (1, 0, 3)
    """
    carries = carry = 0
    while a or b:
        carry = int(a % 10 + b % 10 + carry >= 10)
        carries += carry
        a, b = a // 10, b // 10
    return carries


def column_trace(
    a: int, b: int, *, accuracy: float = 1.0, rng: random.Random | None = None
) -> tuple[str, bool]:
    """The column-by-column response to ``a + b`` and whether its answer is right.

    One line per column from the units up, ``x+y=s`` (``x+y+1=s`` when a carry comes in), then
    ``Answer: ...`` made of the written sums (the last column's whole sum, then the units digit of
    the others). Each column's sum is right with probability ``accuracy`` and otherwise off by 1 or
    2; the next column's carry and the answer follow what was *written*, so the first wrong column
    decides the outcome and every later token is determined by it (a critic that checks the columns
    knows the reward before the answer).

    Example:
        >>> column_trace(57, 38)
        ('7+8=15\\n5+3+1=9\\nAnswer: 95', True)
        >>> text, right = column_trace(57, 38, accuracy=0.0, rng=random.Random(0))
        >>> text.splitlines()[0], right
        ('7+8=17', False)
    """
    if not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"column_trace: accuracy must be in [0, 1], got {accuracy}")
    if a < 0 or b < 0:
        raise ValueError(f"column_trace: operands must be >= 0, got {a} and {b}")
    rng = rng or random.Random(0)
    xs, ys = str(a)[::-1], str(b)[::-1]
    columns = max(len(xs), len(ys))
    lines, digits, carry, right = [], [], 0, True
    for k in range(columns):
        x = int(xs[k]) if k < len(xs) else 0
        y = int(ys[k]) if k < len(ys) else 0
        total = x + y + carry
        if accuracy < 1.0 and rng.random() >= accuracy:
            total = rng.choice([v for v in (total - 2, total - 1, total + 1, total + 2) if v >= 0])
            right = False
        lines.append(f"{x}+{y}{'+1' if carry else ''}={total}")
        carry = int(total >= 10)
        digits.append(str(total) if k == columns - 1 else str(total % 10))
    return "\n".join(lines) + f"\nAnswer: {''.join(reversed(digits))}", right


def critic_arithmetic_rows(
    problems: Sequence[tuple[int, int]], *, name: str = "critic_arithmetic"
) -> MathDataset:
    """DAPO-schema rows of column-addition problems (prompt :data:`COLUMN_TEMPLATE`), with
    ``extra_info`` ``problem`` (``"57 + 38"``), ``digits`` (of the larger operand) and
    ``carries`` (:func:`count_carries`): the difficulty of the row.

    Example:
        >>> row = critic_arithmetic_rows([(57, 38)])[0]
        >>> row["prompt"][0]["content"], row["reward_model"]["ground_truth"], row["extra_info"]
        ('57 + 38', '95', {'index': 0, 'problem': '57 + 38', 'digits': 2, 'carries': 1})
    """
    rows = [
        {
            "data_source": "critic_arithmetic",
            "prompt": [{"role": "user", "content": COLUMN_TEMPLATE.format(a=a, b=b)}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {
                "index": i,
                "problem": f"{a} + {b}",
                "digits": len(str(max(a, b))),
                "carries": count_carries(a, b),
            },
        }
        for i, (a, b) in enumerate(problems)
    ]
    return MathDataset(rows, name=name)


def column_problems(
    num: int,
    *,
    digits: Sequence[int] = (1, 2, 3),
    seed: int = 0,
    exclude: set[tuple[int, int]] | frozenset = frozenset(),
) -> list[tuple[int, int]]:
    """``num`` additions (seeded, with repetition): for each, a digit count drawn uniformly from
    ``digits``, then two operands with that many digits, never a problem in ``exclude`` (which must
    leave some problems of every digit count).

    Example:
        >>> column_problems(3, digits=[1, 3], seed=0)
        [(876, 530), (4, 8), (514, 902)]
    """
    _check_digits("column_problems: ", digits)
    if num < 0:
        raise ValueError(f"column_problems: num must be >= 0, got {num}")
    rng = random.Random(seed)
    out: list[tuple[int, int]] = []
    for _ in range(num):
        low, high = _operand_range(rng.choice(list(digits)))
        pair = (rng.randint(low, high), rng.randint(low, high))
        while pair in exclude:  # redrawn with the same digit count: the mix stays uniform
            pair = (rng.randint(low, high), rng.randint(low, high))
        out.append(pair)
    return out


def _check_digits(prefix: str, digits: Sequence[int]) -> None:
    if not digits or any(not isinstance(d, int) or not 1 <= d <= 6 for d in digits):
        raise ValueError(
            f"{prefix}digits must be a non-empty list of integers in [1, 6], got {digits}"
        )
    if len(set(digits)) != len(digits):
        raise ValueError(f"{prefix}digits has duplicates: {list(digits)}")


def critic_arithmetic_split(
    num_rows: int, holdout: int, *, digits: Sequence[int] = (1, 2, 3), seed: int = 0
) -> tuple[MathDataset, MathDataset]:
    """Training and held-out column-addition rows over disjoint problems.

    The held-out problems are distinct and spread evenly over ``digits`` (problem ``i`` has
    ``digits[i % len(digits)]`` digits); the training rows are drawn (seeded, with repetition) from
    every other problem (:func:`column_problems`).

    Example:
        >>> train, test = critic_arithmetic_split(100, 9, seed=0)
        >>> len(train), len(test), [r["extra_info"]["digits"] for r in test][:3]
        (100, 9, [1, 2, 3])
        >>> {r["extra_info"]["problem"] for r in train}.isdisjoint(
        ...     r["extra_info"]["problem"] for r in test)
        True
    """
    _check_digits("critic_arithmetic_split: ", digits)
    for d in digits:
        share = -(-holdout // len(digits)) if holdout > 0 else 0
        space = (_operand_range(d)[1] - _operand_range(d)[0] + 1) ** 2
        if holdout < 1 or 2 * share > space:
            raise ValueError(
                f"critic_arithmetic_split: holdout={holdout} must be >= 1 and leave at least half "
                f"of the {space} problems with {d} digit(s) to training ({share} held out)"
            )
    if num_rows < 1:
        raise ValueError(f"critic_arithmetic_split: num_rows must be >= 1, got {num_rows}")
    rng = random.Random(seed)
    held: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    while len(held) < holdout:
        low, high = _operand_range(digits[len(held) % len(digits)])
        pair = (rng.randint(low, high), rng.randint(low, high))
        if pair not in seen:
            seen.add(pair)
            held.append(pair)
    train = column_problems(num_rows, digits=digits, seed=seed + 1, exclude=seen)
    return (
        critic_arithmetic_rows(train, name="train"),
        critic_arithmetic_rows(held, name="holdout"),
    )


@register_task(
    "critic_arithmetic",
    help="column addition of 1-3 digit numbers, carries written out: value is learnable",
)
@dataclass
class CriticArithmeticDataConfig:
    """``data=critic_arithmetic``: :func:`critic_arithmetic_split` rows (train and held-out rows
    over disjoint problems)."""

    num_rows: int = 4000  # training rows (drawn with replacement from the training problems)
    digits: list[int] = field(default_factory=lambda: [1, 2, 3])  # operand digit counts
    holdout: int = 64  # held-out problems (one evaluation row each)
    seed: int = 0  # problem split / sampling seed

    def check(self, prefix: str) -> None:
        check_generated_rows(prefix, self.num_rows)
        _check_digits(prefix, list(self.digits))
        check_number(prefix, "holdout", self.holdout, ge=1, integer=True)
        smallest = (
            _operand_range(min(self.digits))[1] - _operand_range(min(self.digits))[0] + 1
        ) ** 2
        if 2 * -(-self.holdout // len(self.digits)) > smallest:
            key = prefix.rsplit(" ", 1)[-1]
            raise ValueError(
                f"{prefix}holdout={self.holdout} holds out more than half of the {smallest} "
                f"problems with {min(self.digits)} digit(s) ({key}digits={list(self.digits)})"
            )

    def build(self) -> tuple[MathDataset, MathDataset]:
        return critic_arithmetic_split(
            self.num_rows, self.holdout, digits=list(self.digits), seed=self.seed
        )
