"""Files that are whole or absent (`or1_trl/files.py`): a JSON file written atomically holds its old content or the
whole new one, never a part; a write that fails part-way leaves its part only under the temporary name."""

import json
import os

import pytest

from or1_trl.files import TMP_INFIX, write_json_atomic


def test_a_json_file_holds_the_old_content_or_the_whole_new_one(tmp_path):
    path = str(tmp_path / "state.json")
    write_json_atomic(path, {"step": 1})
    write_json_atomic(path, {"step": 2, "rows": list(range(1000))})
    with open(path) as f:
        assert json.load(f) == {"step": 2, "rows": list(range(1000))}
    assert os.listdir(tmp_path) == ["state.json"]
    with pytest.raises(TypeError):  # not JSON: the write fails part-way
        write_json_atomic(path, {"step": 3, "bad": object()})
    with open(path) as f:
        assert json.load(f) == {"step": 2, "rows": list(range(1000))}  # the old content, whole
    partial = f"state.json{TMP_INFIX}{os.getpid()}"
    assert sorted(os.listdir(tmp_path)) == ["state.json", partial]
    assert (tmp_path / partial).read_text().startswith('{"step": 3, "bad": ')
