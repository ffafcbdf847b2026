"""DAPO-Math schema loader (parquet/jsonl, validation, skip counters), arithmetic generator, split."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzz import fuzz

from ar_torchrl.data import (
    DAPO_TEMPLATE,
    MathDataset,
    arithmetic_dataset,
    load_dapo_math,
    make_row,
    train_holdout_split,
)
from ar_torchrl.data.datasets import validate_row


def test_arithmetic_rows_are_correct_and_seeded():
    ds = arithmetic_dataset(200, seed=3, max_operand=9)
    assert len(ds) == 200 and ds.num_skipped == 0
    for i, row in enumerate(ds):
        content = row["prompt"][0]["content"]
        assert content.startswith("Solve step by step. End with a line Answer: $Answer\n\n")
        a, b = map(int, re.fullmatch(r"What is (\d) \+ (\d)\?", content.splitlines()[-1]).groups())
        assert row["reward_model"]["ground_truth"] == str(a + b)
        assert row["extra_info"]["index"] == i and row["prompt"][0]["role"] == "user"
    assert list(arithmetic_dataset(200, seed=3)) == list(ds)
    assert list(arithmetic_dataset(200, seed=4)) != list(ds)
    sums = {int(ds.ground_truth(i)) for i in range(len(ds))}
    assert min(sums) >= 0 and max(sums) <= 18 and len(sums) > 10


def test_full_dapo_template():
    row = arithmetic_dataset(1, template="dapo")[0]
    problem = row["prompt"][0]["content"].split("\n\n")[1]
    assert row["prompt"][0]["content"] == DAPO_TEMPLATE.format(problem=problem)
    assert row["prompt"][0]["content"].endswith(
        'Remember to put your answer on its own line after "Answer:".'
    )


def test_jsonl_and_parquet_round_trip(tmp_path):
    rows = [make_row(f"What is {i} + 1?", str(i + 1), index=i) for i in range(5)]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(load_dapo_math(jsonl)) == rows
    parquet = tmp_path / "rows.parquet"
    pd.DataFrame(rows).to_parquet(parquet)  # nested lists come back as numpy arrays
    loaded = load_dapo_math(parquet, limit=3)
    assert list(loaded) == rows[:3]
    assert isinstance(loaded[0]["prompt"], list) and isinstance(loaded[0]["prompt"][0], dict)


def test_invalid_rows_raise_with_index_and_field_or_are_skipped_and_counted(tmp_path):
    good = make_row("What is 1 + 1?", "2", index=0)
    no_truth = {**good, "reward_model": {"style": "rule"}}
    empty_prompt = {**good, "prompt": []}
    no_content = {**good, "prompt": [{"role": "user"}]}
    with pytest.raises(ValueError, match=r"row 1: field 'reward_model.ground_truth' is missing"):
        MathDataset([good, no_truth])
    with pytest.raises(ValueError, match=r"row 2: field 'prompt' must be a non-empty list"):
        MathDataset([good, good, empty_prompt])
    with pytest.raises(
        ValueError, match=r"row 0: field 'prompt\[0\].content' must be a non-empty string"
    ):
        MathDataset([no_content])
    ds = MathDataset([good, no_truth, good, empty_prompt, no_content], skip_invalid=True)
    assert len(ds) == 2 and ds.num_skipped == 3
    assert [i for i, _ in ds.skipped] == [1, 3, 4]
    with pytest.raises(ValueError, match=r"no valid rows \(1 skipped\)"):
        MathDataset([no_truth], skip_invalid=True)


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file at"):
        load_dapo_math(tmp_path / "missing.parquet")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(make_row("q", "1", index=0)) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2: not valid JSON \(Expecting"):
        load_dapo_math(bad)
    csv = tmp_path / "rows.csv"
    csv.write_text("x")
    with pytest.raises(ValueError, match=r"unsupported file type '.csv'"):
        load_dapo_math(csv)


def test_train_holdout_split():
    ds = arithmetic_dataset(50, seed=1)
    train, test = train_holdout_split(ds, 10, seed=0)
    assert len(train) == 40 and len(test) == 10
    key = lambda r: r["extra_info"]["index"]  # noqa: E731
    assert {key(r) for r in train} | {key(r) for r in test} == set(range(50))
    assert not {key(r) for r in train} & {key(r) for r in test}
    again, _ = train_holdout_split(ds, 10, seed=0)
    assert list(again) == list(train)
    assert len(train_holdout_split(ds, 0.2)[1]) == 10
    with pytest.raises(ValueError, match="holdout=50 gives 50 of 50 rows"):
        train_holdout_split(ds, 50)


def test_unreadable_lines_and_bad_extra_info_are_skipped_and_counted_naming_the_line(tmp_path):
    """Non-UTF-8 bytes and a non-dict extra_info used to crash with UnicodeDecodeError/TypeError."""
    good = json.dumps(make_row("What is 1 + 1?", "2", index=0)).encode()
    extra_int = json.dumps({**make_row("q", "3", index=1), "extra_info": 5}).encode()
    extra_list = json.dumps({**make_row("q", "4", index=2), "extra_info": ["a"]}).encode()
    latin1 = (
        json.dumps(make_row("Was kostet das?", "5", index=3))
        .encode()
        .replace(b"kostet", b"k\xf6stet")
    )
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join([good, extra_int, b"", latin1, b"{oops", extra_list, good]) + b"\n")
    ds = load_dapo_math(path, skip_invalid=True)
    assert len(ds) == 2 and ds.num_skipped == 4
    reasons = [msg for _, msg in ds.skipped]
    assert reasons[0].startswith("line 2: field 'extra_info' must be a mapping (or absent), got 5")
    assert re.fullmatch(r"line 4: not valid UTF-8 \(byte 0xf6 at column \d+\)", reasons[1])
    assert reasons[2].startswith("line 5: not valid JSON")
    assert reasons[3].startswith("line 6: field 'extra_info' must be a mapping")
    for lines, msg in [
        (
            [good, extra_int],
            r"mixed.jsonl: line 2: field 'extra_info' must be a mapping .*got 5 \(pass skip_invalid=True",
        ),
        ([good, latin1], r"mixed.jsonl: line 2: not valid UTF-8 \(byte 0xf6 at column \d+\)"),
    ]:
        path.write_bytes(b"\n".join(lines) + b"\n")
        with pytest.raises(ValueError, match=msg):
            load_dapo_math(path)
    with pytest.raises(ValueError, match=r"row 1: field 'extra_info' must be a mapping"):
        MathDataset(
            [make_row("q", "1", index=0), {**make_row("q", "1", index=1), "extra_info": "x"}]
        )


# ----------------------------------------------------------------------------- hostile lines


def test_lines_that_break_the_json_reader_are_named_and_skipped_and_counted(tmp_path):
    """Issue 29 N4: a deeply nested line or a number past 4300 digits gave a raw RecursionError /
    ValueError naming no file or line, also with skip_invalid=True: one bad line stopped the run."""
    good = json.dumps(make_row("What is 1 + 1?", "2", index=0))
    deep = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    huge = json.dumps(make_row("q", "2", index=1)).replace('"2"', "9" * 5000)
    path = tmp_path / "hostile.jsonl"
    path.write_text("\n".join([good, deep, good, huge, good]) + "\n")
    ds = load_dapo_math(path, skip_invalid=True)
    assert len(ds) == 3 and ds.num_skipped == 2
    assert ds.skipped == [
        (1, "line 2: not readable JSON (nested too deeply (RecursionError))"),
        (
            3,
            "line 4: not readable JSON (ValueError: Exceeds the limit (4300 digits) for integer "
            "string conversion: value has 5000 digits)",
        ),
    ]
    for lines, message in [
        ([good, deep], r"hostile.jsonl: line 2: not readable JSON \(nested too deeply"),
        ([good, good, huge], r"hostile.jsonl: line 3: not readable JSON \(ValueError: Exceeds"),
    ]:
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(ValueError, match=message + r".*\(pass skip_invalid=True to skip it\)"):
            load_dapo_math(path)


def test_rows_that_break_validation_are_named_and_skipped_and_counted():
    """Rows that parse but break reading them (parquet records, rows given in Python): nesting past
    the recursion limit, an integer ground truth past 4300 digits."""
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    good = make_row("q", "1", index=0)
    rows = [
        good,
        {**good, "prompt": [{"role": "user", "content": "q", "more": deep}]},
        {**good, "reward_model": {"ground_truth": 10**5000}},
        good,
    ]
    ds = MathDataset(rows, skip_invalid=True, name="records")
    assert len(ds) == 2 and [i for i, _ in ds.skipped] == [1, 2]
    assert ds.skipped[0][1] == "row 1: nested too deeply (RecursionError)"
    assert ds.skipped[1][1].startswith("row 2: ValueError: Exceeds the limit (4300 digits)")
    with pytest.raises(ValueError, match=r"records: row 1: nested too deeply \(RecursionError\)"):
        MathDataset(rows, name="records")


# ----------------------------------------------------------------------------- property-based

_GOOD = json.dumps(make_row("What is 1 + 1?", "2", index=0))
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)


@st.composite
def _mutated_rows(draw):
    """A valid row with one field (at any depth) replaced by any JSON value."""
    row = make_row("What is 2 + 2?", "4", index=draw(st.integers(-5, 5)))
    path = draw(
        st.sampled_from(
            [
                ("prompt",),
                ("prompt", 0),
                ("prompt", 0, "role"),
                ("prompt", 0, "content"),
                ("reward_model",),
                ("reward_model", "ground_truth"),
                ("extra_info",),
                ("extra_info", "index"),
                ("data_source",),
            ]
        )
    )
    target = row
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = draw(_json_values)
    return json.dumps(row)


lines = st.one_of(
    st.text(max_size=60).filter(lambda t: "\n" not in t),
    _json_values.map(json.dumps),
    _mutated_rows(),
    st.integers(0, 3000).map(lambda n: "[" * n + "]" * n),
    st.integers(4000, 6000).map(lambda n: '{"prompt": ' + "1" * n + "}"),
)


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "rows.jsonl"


@fuzz(150)
@given(line=lines)
def test_any_jsonl_line_is_a_row_or_a_named_skipped_invalid_line(fuzz_file, line):
    fuzz_file.write_text("\n".join([_GOOD, line, _GOOD]) + "\n", encoding="utf-8")
    ds = load_dapo_math(fuzz_file, skip_invalid=True)
    if not line.strip():  # a blank line is no row
        assert len(ds) == 2 and ds.num_skipped == 0
        return
    if len(ds) == 3:
        same = json.dumps(validate_row(json.loads(line), 1), sort_keys=True)  # NaN == NaN here
        assert ds.num_skipped == 0 and json.dumps(ds[1], sort_keys=True) == same
        assert json.dumps(load_dapo_math(fuzz_file)[1], sort_keys=True) == same
        return
    assert len(ds) == 2 and [i for i, _ in ds.skipped] == [1]
    assert ds.skipped[0][1].startswith("line 2: ")
    with pytest.raises(ValueError, match=r"rows\.jsonl: line 2: .*\(pass skip_invalid=True"):
        load_dapo_math(fuzz_file)
