"""Loading data (`or1_trl/data/loading.py`): what `--dataset_name` names, read or refused in one line; `save_split`
writes a split where it is read back. Through the command line: tests/cli/test_commands.py, tests/cli/test_errors.py."""

import os

import pytest
from datasets import Dataset

from or1_trl.data.loading import load_data, save_split

ROWS = [{"prompt": f"{i}+1=?", "answer": str(i + 1)} for i in range(3)]


def test_a_saved_split_is_read_back_and_leaves_no_temporary_file(tmp_path):
    path = save_split(Dataset.from_list(ROWS), str(tmp_path), "math")
    assert path == str(tmp_path / "data" / "math-00000-of-00001.parquet")
    assert os.listdir(tmp_path / "data") == ["math-00000-of-00001.parquet"]
    assert load_data(str(tmp_path), split="math").to_list() == ROWS
    assert load_data(None, data_files=[path]).to_list() == ROWS  # the builder from the extension


@pytest.mark.parametrize("name,content,message", [
    ("missing.jsonl", None, "dataset {path!r} does not exist"),
    ("empty.jsonl", b"", "dataset file {path!r} is empty"),
    ("rows.txt", b"a\n", "dataset file {path!r} is not .jsonl, .json, .parquet, .csv"),
    ("latin1.jsonl", '{"prompt": "caf\u00e9"}\n'.encode("latin-1"), "cannot load dataset {path!r}: not UTF-8 text"),
])
def test_what_cannot_be_loaded_is_one_line_naming_it(tmp_path, name, content, message):
    path = str(tmp_path / name)
    if content is not None:
        with open(path, "wb") as f:
            f.write(content)
    with pytest.raises(ValueError) as error:
        load_data(path)
    assert str(error.value).startswith(message.format(path=path)) and "\n" not in str(error.value)


def test_no_dataset_and_data_files_of_unknown_format_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^no dataset: pass --dataset_name"):
        load_data(None)
    (tmp_path / "rows.txt").write_text("a\n")
    with pytest.raises(ValueError, match=r"^cannot tell the format of '.*rows\.txt': name it with --dataset_name"):
        load_data(None, data_files=[str(tmp_path / "rows.txt")])
