"""Dataset loading and prompt preparation: columns, string prompts, system prompts, order across epochs."""

from __future__ import annotations

import json
import re

import pytest

from asyncgrpo_cli.config.schema import DataConfig
from asyncgrpo_cli.data.sources import PromptOrder, load_hf, load_prompts, prepare_dataset
from asyncgrpo_cli.errors import UserError


def _jsonl(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_string_prompts_become_one_user_message_and_columns_survive(tmp_path):
    path = _jsonl(tmp_path, [{"question": "2+2?", "solution": "4"}, {"question": "3+3?", "solution": "6"}])
    ds = load_prompts(
        DataConfig(source="hf", path=str(path), prompt_column="question", system_prompt="Be brief.")
    )
    assert ds[0]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
    ]
    assert ds[1]["solution"] == "6" and "question" not in ds.column_names


def test_missing_prompt_column_lists_the_columns(tmp_path):
    path = _jsonl(tmp_path, [{"question": "2+2?", "solution": "4"}])
    with pytest.raises(
        UserError,
        match=r"data.prompt_column 'prompt' is not a column of the dataset \(columns: "
        r"question, solution\)",
    ):
        load_prompts(DataConfig(source="hf", path=str(path)))


def test_malformed_prompt_names_the_row(tmp_path):
    path = _jsonl(
        tmp_path, [{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": [{"text": "no role"}]}]
    )
    ds = load_hf(DataConfig(source="hf", path=str(path)))
    with pytest.raises(UserError, match="row 1 holds list"):
        prepare_dataset(ds, DataConfig(source="hf", path=str(path)))


def test_bad_paths_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="data.path is required"):
        load_hf(DataConfig(source="hf"))
    bad = tmp_path / "x.txt"
    bad.write_text("hello")
    with pytest.raises(UserError, match="unsupported file type '.txt'"):
        load_hf(DataConfig(source="hf", path=str(bad)))


def test_prompt_order_is_a_seeded_permutation_per_epoch():
    order = PromptOrder(num_rows=5, seed=3, shuffle=True)
    first = [order.row_index(i)[1] for i in range(5)]
    second = [order.row_index(i)[1] for i in range(5, 10)]
    assert sorted(first) == sorted(second) == list(range(5))
    assert order.row_index(7)[0] == 1
    again = PromptOrder(num_rows=5, seed=3, shuffle=True)
    assert [again.row_index(i)[1] for i in range(10)] == first + second  # reproducible across resumes
    assert [PromptOrder(5, 3, shuffle=False).row_index(i)[1] for i in range(5)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "name,content,what",
    [
        ("data.jsonl", b"", "is an empty file"),
        ("data.jsonl", b"\n  \n", "is an empty file"),
        ("data.json", b"", "is an empty file"),
        ("data.csv", b"", "is an empty file"),
        ("data.parquet", b"", "is an empty file"),
        ("data.json", b"[]", "holds no rows"),
        ("data.csv", b"prompt\n", "holds no rows"),
    ],
)
def test_an_empty_data_file_is_named(tmp_path, name, content, what):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UserError, match=re.escape(f"data.path '{path}' {what}: the dataset is empty")):
        load_prompts(DataConfig(source="hf", path=str(path)))


def test_a_directory_of_empty_data_files_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    with pytest.raises(UserError, match=re.escape(f"data.path '{tmp_path}' holds only empty data files")):
        load_prompts(DataConfig(source="hf", path=str(tmp_path)))


def test_num_examples_from_a_recipe_warns_once_that_it_cuts_the_users_file(tmp_path, caplog):
    from asyncgrpo_cli.config.compose import compose_config

    path = _jsonl(tmp_path, [{"prompt": f"{i}+1?"} for i in range(70)])
    data = compose_config(["+recipe=tiny", "data.source=hf", f"data.path={path}"]).data
    assert data.num_examples == 64  # the tiny recipe's data group sets it
    with caplog.at_level("WARNING", logger="asyncgrpo_cli.data.sources"):
        assert len(load_hf(data)) == 64
    (record,) = [r for r in caplog.records if r.name == "asyncgrpo_cli.data.sources"]
    text = record.getMessage()
    assert "data.num_examples=64 keeps only the first 64 of the 70 rows" in text and str(path) in text
    assert "set data.num_examples=null to train on every row" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="asyncgrpo_cli.data.sources"):
        assert len(load_hf(DataConfig(source="hf", path=str(path), num_examples=None))) == 70
        assert len(load_hf(DataConfig(source="hf", path=str(path), num_examples=70))) == 70
    assert not caplog.records  # nothing is cut: no warning
