"""The safetensors reading under zeroshard.load_pretrained (checkpoint/pretrained.py): headers,
the folders save_pretrained writes, element ranges read in chunks and converted."""

import json

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroshard.checkpoint import pretrained


def _files(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(7, 13, generator=g),
        "b": torch.randn(101, generator=g).to(torch.bfloat16),
        "c": torch.randn(3, 5, 2, generator=g).half(),
        "d": torch.arange(11, dtype=torch.int64),
    }
    safetensors.torch.save_file({k: tensors[k] for k in "ab"}, str(tmp_path / "model-1.safetensors"))
    safetensors.torch.save_file({k: tensors[k] for k in "cd"}, str(tmp_path / "model-2.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-1.safetensors",
            "b": "model-1.safetensors",
            "c": "model-2.safetensors",
            "d": "model-2.safetensors",
        },
    }
    (tmp_path / pretrained.INDEX_NAME).write_text(json.dumps(index))
    return tensors


def test_headers_and_folders(tmp_path):
    tensors = _files(tmp_path)
    files = pretrained.weight_files(str(tmp_path))
    assert [f.split("/")[-1] for f in files] == ["model-1.safetensors", "model-2.safetensors"]
    assert pretrained.weight_files(files[0]) == [files[0]] and pretrained.weight_files(files) == files
    entries = pretrained.index(files)
    assert {k: (e.dtype, e.shape) for k, e in entries.items()} == {
        k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()
    }
    (tmp_path / pretrained.INDEX_NAME).unlink()  # no index: every *.safetensors file
    assert pretrained.weight_files(str(tmp_path)) == files
    with pytest.raises(ValueError, match="'a' is in both"):
        pretrained.index(files + [files[0]])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no safetensors"):
        pretrained.weight_files(str(tmp_path / "empty"))
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match="not a safetensors file"):
        pretrained.read_header(str(tmp_path / "bad.safetensors"))


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from("abcd"),
    start=st.integers(0, 100),
    length=st.integers(0, 100),
    chunk=st.sampled_from([1, 2, 6, 24, 1 << 20]),
    out_dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_element_ranges_read_in_chunks_and_converted(tmp_path_factory, name, start, length, chunk, out_dtype):
    tmp = tmp_path_factory.mktemp("st")
    tensors = _files(tmp)
    e = pretrained.index(pretrained.weight_files(str(tmp)))[name]
    start = min(start, e.numel)
    length = min(length, e.numel - start)
    out = torch.full((length,), -7.0, dtype=out_dtype)
    old = pretrained.READ_BYTES
    pretrained.READ_BYTES = chunk  # reads of a few bytes: many chunks, each a whole element
    try:
        reader = pretrained.SafetensorsReader()
        reader.read(e, start, out)
        reader.close()
    finally:
        pretrained.READ_BYTES = old
    assert torch.equal(out, tensors[name].reshape(-1)[start : start + length].to(out_dtype))


def test_a_truncated_file_is_an_error_not_garbage(tmp_path):
    _files(tmp_path)
    path = tmp_path / "model-1.safetensors"
    e = pretrained.read_header(str(path))["b"]
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(OSError, match="truncated"):
        pretrained.SafetensorsReader().read(e, 0, torch.empty(e.numel))
