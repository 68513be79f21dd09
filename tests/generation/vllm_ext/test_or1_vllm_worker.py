"""The server's worker extension (`or1_trl/generation/vllm_ext/or1_vllm_worker.py`): the folder check of a reload."""

import os

import pytest
import torch

from or1_trl.generation.weight_files import write_safetensors


def test_the_folder_check_takes_only_complete_safetensors_under_a_sync_root(tmp_path, monkeypatch):
    """`check_weights_dir`, the server's check before a reload, without a server: what the streaming writer writes
    passes; headers that are not safetensors', a missing tensor, or no sync root at all are one-line refusals."""
    import struct

    from or1_trl.generation.vllm_ext.or1_vllm_worker import SYNC_ROOTS_ENV, check_weights_dir

    monkeypatch.setenv(SYNC_ROOTS_ENV, str(tmp_path))
    tensors = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    write_safetensors(tensors.items(), str(tmp_path / "good"))
    os.chmod(tmp_path / "good", 0o700)  # the server loads only folders no other user can write to (test_server_access)
    assert check_weights_dir(str(tmp_path / "good"), {"a", "b"}) == (str(tmp_path / "good"), {"a", "b"})
    with pytest.raises(ValueError, match=r"lacks 1 of the model's 3 tensors \(e.g. 'c'\)"):
        check_weights_dir(str(tmp_path / "good"), {"a", "b", "c"})
    for header in (b"[1, 2]", b'{"a": 3}', b'{"a": {"data_offsets": [0]}}', b"not json", b"{}" + b" " * 10**6):
        folder = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        folder.mkdir(mode=0o700)
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header[:100])
        with pytest.raises(ValueError) as refused:
            check_weights_dir(str(folder))
        assert "\n" not in str(refused.value) and "model.safetensors" in str(refused.value)
    monkeypatch.delenv(SYNC_ROOTS_ENV)
    with pytest.raises(ValueError, match="this server has no sync root"):
        check_weights_dir(str(tmp_path / "good"))
