"""DAPO-Math schema loader (parquet/jsonl, validation, skip counters), arithmetic generator, split."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from ar_torchrl.data import (
    DAPO_TEMPLATE,
    MathDataset,
    arithmetic_dataset,
    load_dapo_math,
    make_row,
    train_holdout_split,
)


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
