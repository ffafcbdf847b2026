"""Prompt datasets in the DAPO-Math-17k schema: a validating loader and an offline arithmetic generator.

A row is a plain dict (docs/design.md section 5)::

    {"data_source": str, "prompt": [{"role": "user", "content": str}, ...], "ability": str,
     "reward_model": {"ground_truth": str, "style": str}, "extra_info": {"index": int}}

:class:`MathDataset` is a ``Sequence`` of such rows, so anything that takes DAPO rows (the warm start,
:class:`~ar_torchrl.envs.LLMEnv`) takes it. Rows are validated on load; an invalid row (a wrong field,
in a ``.jsonl`` file a line that is not UTF-8 or not JSON, or content that breaks reading it: nesting
past the recursion limit, an integer past Python's 4300 digits) raises a ``ValueError`` naming the
file, the row (the line, for ``.jsonl``) and the field or what broke, or, with ``skip_invalid=True``,
is skipped *and counted* (``dataset.num_skipped``, ``dataset.skipped``).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ar_torchrl.data.registry import register_task
from ar_torchrl.utils.checks import check_choice, check_number

__all__ = [
    "DAPO_TEMPLATE",
    "SHORT_TEMPLATE",
    "MathDataset",
    "arithmetic_dataset",
    "load_dapo_math",
    "make_row",
    "train_holdout_split",
    "validate_row",
]

logger = logging.getLogger(__name__)

#: Most rows a generated task makes (they are built in memory, about 1 KB each: 1 GB).
MAX_GENERATED_ROWS = 1_000_000


def check_generated_rows(prefix: str, num_rows: Any) -> None:
    """``num_rows`` of a generated task: an integer in ``[1, MAX_GENERATED_ROWS]``."""
    check_number(
        prefix,
        "num_rows",
        num_rows,
        ge=1,
        le=MAX_GENERATED_ROWS,
        integer=True,
        hint="the rows are generated in memory, about 1 KB each",
    )


#: DAPO-Math-17k's prompt, verbatim (``{problem}`` is substituted).
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
#: A short DAPO-style prompt for tiny character-level models (docs/design.md section 5).
SHORT_TEMPLATE = "Solve step by step. End with a line Answer: $Answer\n\n{problem}"
TEMPLATES = {"dapo": DAPO_TEMPLATE, "short": SHORT_TEMPLATE}


def make_row(
    problem: str,
    answer: str,
    *,
    index: int,
    template: Literal["dapo", "short"] = "dapo",
    data_source: str = "arithmetic",
) -> dict:
    """Build one DAPO-schema row for ``problem`` with reference ``answer``.

    Example:
        >>> row = make_row("What is 7 + 5?", "12", index=3, template="short")
        >>> row["prompt"][0]["content"].splitlines()[-1], row["reward_model"]["ground_truth"]
        ('What is 7 + 5?', '12')
    """
    if template not in TEMPLATES:
        raise ValueError(f"make_row: template must be one of {sorted(TEMPLATES)}, got {template!r}")
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": TEMPLATES[template].format(problem=problem)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(answer), "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": int(index)},
    }


def _plain(value):
    """numpy arrays / pandas objects from parquet -> plain lists and dicts."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class _RowError(ValueError):
    """An invalid row, named (what :func:`validate_row` raises)."""


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise _RowError(
            f"{where}: field 'prompt' must be a non-empty list of chat messages, got {messages!r:.80}"
        )
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise _RowError(f"{where}: field 'prompt[{j}]' needs a string 'role', got {m!r:.80}")
        if not isinstance(m.get("content"), str) or not m["content"]:
            raise _RowError(
                f"{where}: field 'prompt[{j}].content' must be a non-empty string, got {m!r:.80}"
            )


class InvalidRecord(str):
    """A record that could not even be read (its text says why); :func:`validate_row` rejects it."""


def _unreadable(err: BaseException) -> str:
    """What broke on a row's content: nesting past the recursion limit, an integer past Python's
    4300 digits, or another exception (its class and the first clause of its message)."""
    if isinstance(err, RecursionError):
        return "nested too deeply (RecursionError)"
    return f"{type(err).__name__}: {str(err).split(';')[0][:160]}"


def validate_row(row, index: int, *, where: str | None = None) -> dict:
    """Check one row against the DAPO-Math schema; return it as plain Python objects.

    Integer ground truths are turned into strings; missing optional fields get defaults
    (``extra_info.index`` defaults to ``index``).

    Args:
        row: the raw row.
        index: its index (the default of ``extra_info.index``).
        where: how errors name the row (default ``"row {index}"``; e.g. ``"line 7"``).

    Raises:
        ValueError: naming the row and the field that is wrong, or, for content that breaks
            reading it (nesting past the recursion limit, an integer past 4300 digits, ...), what
            broke.

    Example:
        >>> validate_row({"prompt": [{"role": "user", "content": "1+1?"}],
        ...               "reward_model": {"ground_truth": 2}}, 0)["reward_model"]["ground_truth"]
        '2'
        >>> try:
        ...     validate_row({"prompt": [{"role": "user", "content": "1+1?"}],
        ...                   "reward_model": {"ground_truth": 10**5000}}, 3, where="line 4")
        ... except ValueError as err:
        ...     print(err)
        line 4: ValueError: Exceeds the limit (4300 digits) for integer string conversion
    """
    where = where or f"row {index}"
    try:
        return _validated(row, index, where)
    except _RowError:
        raise
    except Exception as err:  # any fault of the row's content is an invalid row, named
        raise _RowError(f"{where}: {_unreadable(err)}") from None


def _validated(row, index: int, where: str) -> dict:
    if isinstance(row, InvalidRecord):
        raise _RowError(f"{where}: {row}")
    row = _plain(row)
    if not isinstance(row, Mapping):
        raise _RowError(f"{where}: expected a mapping, got {type(row).__name__}")
    _check_messages(row.get("prompt"), where)
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
        raise _RowError(
            f"{where}: field 'reward_model.ground_truth' is missing (got reward_model="
            f"{reward_model!r:.80})"
        )
    truth = reward_model["ground_truth"]
    if isinstance(truth, bool) or not isinstance(truth, (str, int)) or str(truth).strip() == "":
        raise _RowError(
            f"{where}: field 'reward_model.ground_truth' must be a non-empty string, got {truth!r}"
        )
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise _RowError(
            f"{where}: field 'extra_info' must be a mapping (or absent), got {extra!r:.80}"
        )
    extra = dict(extra or {})
    extra.setdefault("index", index)
    return {
        "data_source": str(row.get("data_source", "")),
        "prompt": [dict(m) for m in row["prompt"]],
        "ability": str(row.get("ability", "")),
        "reward_model": {**reward_model, "ground_truth": str(truth)},
        "extra_info": extra,
    }


class MathDataset(Sequence):
    """Validated DAPO-schema rows, with a record of skipped rows.

    Args:
        rows: raw rows (dicts, or parquet records).
        skip_invalid: skip (and count) invalid rows instead of raising.
        name: shown in log messages.
        lines: the source line of each row (``.jsonl``): errors then name ``line N``, not ``row i``.
        sources: where each row comes from, as messages name it (default ``"<name> line N"`` /
            ``"<name> row i"``); kept through :func:`train_holdout_split` (:meth:`source`).

    Example:
        >>> ds = MathDataset([{"prompt": [{"role": "user", "content": "1+1?"}],
        ...                    "reward_model": {"ground_truth": "2"}}, {"prompt": []}],
        ...                  skip_invalid=True)
        >>> len(ds), ds.num_skipped, ds.ground_truth(0)
        (1, 1, '2')
    """

    def __init__(
        self,
        rows: Iterable,
        *,
        skip_invalid: bool = False,
        name: str = "dataset",
        lines: Sequence[int] | None = None,
        sources: Sequence[str] | None = None,
    ) -> None:
        self.name = name
        self.rows: list[dict] = []
        self.sources: list[str] = []
        self.skipped: list[tuple[int, str]] = []
        for i, raw in enumerate(rows):
            try:
                where = None if lines is None else f"line {lines[i]}"
                self.rows.append(validate_row(raw, i, where=where))
                self.sources.append(sources[i] if sources else f"{name} {where or f'row {i}'}")
            except ValueError as err:
                if not skip_invalid:
                    raise ValueError(f"{name}: {err} (pass skip_invalid=True to skip it)") from None
                self.skipped.append((i, str(err)))
        if self.skipped:
            logger.warning(
                "%s: skipped %d invalid rows, first: %s",
                name,
                len(self.skipped),
                self.skipped[0][1],
            )
        if not self.rows:
            raise ValueError(f"{name}: no valid rows ({len(self.skipped)} skipped)")

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def subset(self, indices: Sequence[int], name: str | None = None) -> MathDataset:
        """The rows ``indices`` (in that order) as a dataset of their own, sources kept."""
        return MathDataset(
            [self.rows[i] for i in indices],
            name=name or self.name,
            sources=[self.sources[i] for i in indices],
        )

    def source(self, i: int) -> str:
        """Where row ``i`` comes from (``"data/dapo.jsonl line 7"``), for messages."""
        return self.sources[i]

    def messages(self, i: int) -> list[dict]:
        """Chat messages of row ``i``."""
        return self.rows[i]["prompt"]

    def ground_truth(self, i: int) -> str:
        """Reference answer of row ``i``."""
        return self.rows[i]["reward_model"]["ground_truth"]


def load_dapo_math(
    path: str | Path, *, skip_invalid: bool = False, limit: int | None = None
) -> MathDataset:
    """Load DAPO-Math-17k (``.parquet`` via pandas/pyarrow, or ``.jsonl``/``.json`` lines).

    Args:
        path: the file.
        skip_invalid: skip invalid rows (counted in ``num_skipped``) instead of raising.
        limit: keep only the first ``limit`` raw rows.

    Example:
        >>> import json, tempfile
        >>> f = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
        >>> _ = f.write(json.dumps(make_row("What is 1 + 1?", "2", index=0)) + "\\n"); f.close()
        >>> len(load_dapo_math(f.name))
        1
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_dapo_math: no file at {path}")
    lines = None
    if path.suffix == ".parquet":
        import pandas as pd  # test/data extra; only needed for parquet

        records = pd.read_parquet(path).to_dict(orient="records")
    elif path.suffix in (".jsonl", ".json"):
        records, lines = _read_jsonl(path)
    else:
        raise ValueError(
            f"load_dapo_math: unsupported file type {path.suffix!r}; use .parquet or .jsonl"
        )
    if limit is not None:
        records, lines = records[:limit], None if lines is None else lines[:limit]
    return MathDataset(records, skip_invalid=skip_invalid, name=str(path), lines=lines)


def _read_jsonl(path: Path) -> tuple[list, list[int]]:
    """Records and their line numbers; unreadable lines become :class:`InvalidRecord` entries."""
    records, lines = [], []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig")
            except UnicodeDecodeError as err:
                records.append(
                    InvalidRecord(
                        f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
                    )
                )
                lines.append(line_no)
                continue
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                records.append(InvalidRecord(f"not valid JSON ({err})"))
            except Exception as err:  # too deep, a number past 4300 digits: named, skippable
                records.append(InvalidRecord(f"not readable JSON ({_unreadable(err)})"))
            lines.append(line_no)
    return records, lines


def arithmetic_dataset(
    num_rows: int,
    *,
    seed: int = 0,
    template: Literal["dapo", "short"] = "short",
    max_operand: int = 9,
) -> MathDataset:
    """Offline single-digit addition problems ("What is 7 + 5?") in the DAPO-Math schema.

    Example:
        >>> ds = arithmetic_dataset(4, seed=0)
        >>> ds.messages(0)[0]["content"].splitlines()[-1], ds.ground_truth(0)
        ('What is 6 + 6?', '12')
    """
    if num_rows < 1:
        raise ValueError(f"arithmetic_dataset: num_rows must be >= 1, got {num_rows}")
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append(make_row(f"What is {a} + {b}?", str(a + b), index=i, template=template))
    return MathDataset(rows, name="arithmetic")


def train_holdout_split(
    dataset: Sequence[dict], holdout: int | float, *, seed: int = 0
) -> tuple[MathDataset, MathDataset]:
    """Split rows into a training set and a held-out set (seeded shuffle, disjoint).

    Args:
        dataset: rows.
        holdout: number of held-out rows (int) or a fraction in ``(0, 1)``.
        seed: shuffle seed.

    Example:
        >>> train, test = train_holdout_split(arithmetic_dataset(10), 0.2)
        >>> len(train), len(test)
        (8, 2)
    """
    n = len(dataset)
    k = round(holdout * n) if isinstance(holdout, float) else int(holdout)
    if not 0 < k < n:
        raise ValueError(
            f"train_holdout_split: holdout={holdout!r} gives {k} of {n} rows; both splits must be non-empty"
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    rows = list(dataset)
    src = getattr(dataset, "sources", None) or [f"row {i}" for i in range(n)]
    test = MathDataset(
        [rows[i] for i in order[:k]], name="holdout", sources=[src[i] for i in order[:k]]
    )
    train = MathDataset(
        [rows[i] for i in order[k:]], name="train", sources=[src[i] for i in order[k:]]
    )
    return train, test


# --------------------------------------------------------------------------- registered tasks
# OmegaConf reads the annotations at run time: they must stay `Optional[...]`, not `X | None`.
@register_task("arithmetic", help="generated single-digit addition in the DAPO-Math schema")
@dataclass
class ArithmeticDataConfig:
    """``data=arithmetic``: :func:`arithmetic_dataset` rows, a seeded held-out split."""

    num_rows: int = 2000  # generated problems
    max_operand: int = 9  # operands in [0, max_operand]
    template: str = "short"  # short (tiny models) | dapo (DAPO-Math-17k's full prompt)
    holdout: int = 64  # rows held out for evaluation
    seed: int = 0  # generation / split seed

    def check(self, prefix: str) -> None:
        check_generated_rows(prefix, self.num_rows)
        check_number(prefix, "max_operand", self.max_operand, ge=0, integer=True)
        check_choice(prefix, "template", self.template, ("short", "dapo"))
        check_number(prefix, "holdout", self.holdout, ge=1, integer=True)
        if self.holdout >= self.num_rows:
            raise ValueError(
                f"{prefix}holdout={self.holdout} must be < {prefix.rsplit(' ', 1)[-1]}num_rows="
                f"{self.num_rows}"
            )

    def build(self) -> tuple[MathDataset, MathDataset]:
        rows = arithmetic_dataset(
            self.num_rows, seed=self.seed, template=self.template, max_operand=self.max_operand
        )
        return train_holdout_split(rows, self.holdout, seed=self.seed)


@register_task("dapo_math", help="DAPO-Math-17k (or any file in its schema) from a local file")
@dataclass
class DapoMathDataConfig:
    """``data=dapo_math``: :func:`load_dapo_math` of a local parquet/jsonl, a held-out split."""

    path: str = "data/dapo-math-17k.parquet"  # local file (download it beforehand)
    holdout: int = 256  # rows held out for evaluation
    seed: int = 0  # split seed
    skip_invalid: bool = False  # skip malformed rows (counted and logged) instead of failing
    limit: int | None = None  # keep only the first N rows (None = all)

    def check(self, prefix: str) -> None:
        check_number(prefix, "holdout", self.holdout, ge=1, integer=True)
        check_number(prefix, "limit", self.limit, ge=1, integer=True, allow_none=True)

    def build(self) -> tuple[MathDataset, MathDataset]:
        rows = load_dapo_math(self.path, skip_invalid=self.skip_invalid, limit=self.limit)
        if rows.num_skipped:
            logger.warning("data: skipped %d malformed rows of %s", rows.num_skipped, self.path)
        return train_holdout_split(rows, self.holdout, seed=self.seed)
