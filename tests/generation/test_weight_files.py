"""The weight files of the disk sync (issue 26): the streaming safetensors writer (standard files in the asked dtype,
one tensor held at a time), created new with the asked mode."""

import os
import stat

import pytest
import torch
from safetensors import safe_open

from or1_trl.generation.weight_files import HEADER_BYTES, write_safetensors


def read_dir(directory):
    tensors = {}
    for name in sorted(os.listdir(directory)):
        with safe_open(os.path.join(directory, name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def test_streaming_writer_writes_standard_safetensors_in_the_asked_dtype(tmp_path):
    tensors = {
        "a.weight": torch.randn(3, 5), "b.weight": torch.randn(7, dtype=torch.float64), "c.scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4), "ids": torch.arange(5), "mask": torch.tensor([True, False]),
        "strided": torch.randn(6, 4).t(),  # not contiguous
    }
    count, written = write_safetensors(tensors.items(), str(tmp_path / "same"))
    assert count == len(tensors) and written == sum(t.numel() * t.element_size() for t in tensors.values())
    back = read_dir(tmp_path / "same")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert all(back[k].dtype == tensors[k].dtype for k in tensors)

    # a dtype casts floating-point tensors only (as vLLM's loader would: round to nearest even), and shards split
    count, written = write_safetensors(tensors.items(), str(tmp_path / "bf16"), shard_bytes=20, dtype=torch.bfloat16)
    back = read_dir(tmp_path / "bf16")
    assert len(os.listdir(tmp_path / "bf16")) > 2
    for key, tensor in tensors.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert back[key].dtype == expected.dtype and torch.equal(back[key], expected), key
    assert written == sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in tensors.values())

    # each file: 8-byte length, the space-padded header, then exactly the tensors' bytes (nothing held twice)
    path = tmp_path / "same" / "model-00001.safetensors"
    assert os.path.getsize(path) == 8 + HEADER_BYTES + sum(t.numel() * t.element_size() for t in tensors.values())
    with open(path, "rb") as f:
        assert int.from_bytes(f.read(8), "little") == HEADER_BYTES and f.read(HEADER_BYTES).rstrip(b" ").endswith(b"}")


def test_streaming_writer_holds_one_tensor_at_a_time(tmp_path):
    """The writer consumes its iterator lazily: when the k-th tensor is produced, the bytes of the k-1 before it
    are already in the file (a gathered parameter can be released as soon as the next one is asked for)."""
    tensors = [(f"t{i}", torch.full((1000,), float(i))) for i in range(5)]
    path = tmp_path / "w" / "model-00001.safetensors"
    sizes = []

    def produce():
        for name, tensor in tensors:
            sizes.append(os.path.getsize(path) if path.exists() else 0)
            yield name, tensor

    write_safetensors(produce(), str(tmp_path / "w"))
    assert sizes[1:] == [8 + HEADER_BYTES + 4000 * k for k in range(1, 5)]


def test_files_are_created_new_with_the_asked_mode(tmp_path):
    """The writer creates every file exclusively: a file or a symlink already at a shard's name is an error, never
    written through; `mode` sets the files' permissions (0600 in the private tmpfs directory)."""
    tensors = [("a", torch.ones(3)), ("b", torch.zeros(2))]
    write_safetensors(tensors, str(tmp_path / "private"), mode=0o600)
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in (tmp_path / "private").iterdir()] == [0o600]
    (tmp_path / "planted").mkdir()
    (tmp_path / "planted" / "model-00001.safetensors").symlink_to(tmp_path / "victim.safetensors")
    with pytest.raises(FileExistsError):
        write_safetensors(tensors, str(tmp_path / "planted"))
    assert not (tmp_path / "victim.safetensors").exists()
