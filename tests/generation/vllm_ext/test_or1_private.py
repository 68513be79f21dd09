"""The user's folders and key files (`or1_trl/generation/vllm_ext/or1_private.py`): a private folder of ours is a sync
root; a key file is read only if nobody else could have written or read it."""

import os
import stat

import pytest

from or1_trl.generation.vllm_ext.or1_private import private_problem, read_key, sync_root_problem, write_key
from ...helpers import KEY, NOBODY, needs_root, private


def test_a_private_folder_of_ours_is_a_sync_root(tmp_path):
    from or1_trl.generation.serve import SYNC_ROOTS_ENV, build_command, user_dir

    assert sync_root_problem(private(tmp_path)) is None and private_problem(user_dir()) is None
    (tmp_path / "link").symlink_to(tmp_path)  # a link to one is resolved first
    env = build_command("m", "disk", sync_roots=[str(tmp_path / "link")])[1]
    assert env[SYNC_ROOTS_ENV] == str(tmp_path)
    assert build_command("m", "disk")[1][SYNC_ROOTS_ENV] == user_dir()  # the default: this user's tmpfs folder


def test_a_key_file_is_read_only_if_nobody_else_could_have_written_or_read_it(tmp_path):
    needs_root()
    (tmp_path / "keys").mkdir()
    folder = private(tmp_path / "keys")
    path = os.path.join(folder, "vllm-server-1.key")
    write_key(path, KEY)
    assert read_key(path) == KEY and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.chown(path, NOBODY, NOBODY)
    assert read_key(path) is None
    os.remove(path)
    os.symlink(tmp_path / "elsewhere.key", path)  # a link is never read, and replaced (not written through)
    (tmp_path / "elsewhere.key").write_text(KEY)
    os.chmod(tmp_path / "elsewhere.key", 0o600)
    assert read_key(path) is None
    write_key(path, "k2")
    assert read_key(path) == "k2" and (tmp_path / "elsewhere.key").read_text() == KEY
    os.chmod(folder, 0o755)
    assert read_key(path) is None  # a folder others can enter
    with pytest.raises(PermissionError, match="has mode 0755"):
        write_key(path, "k3")
