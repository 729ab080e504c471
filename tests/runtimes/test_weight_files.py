"""Weight files a load could not read are refused at registration (`check_loadable`, `check_adapter_folder`), from
their safetensors headers: a file cut short, a header that is not one, a shard the index names that is not there.
Such folders registered (201) and then failed every load with a 503 (planning item)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from runtimes import ModelSource, RuntimeKind, Task, UnsupportedModel, load_runtime
from runtimes.adapter_check import check_adapter_folder
from runtimes.detect import check_loadable

# What a clone without `git lfs` leaves in place of the weights.
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 90868376\n"


def _copy(source: Path, folder: Path) -> Path:
    shutil.copytree(source, folder)
    return folder


def _cut(file: Path, bytes_off: int) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:-bytes_off])


def test_weights_cut_short_are_refused_at_registration_as_the_load_refuses_them(
    encoder_dir: Path, tmp_path: Path
) -> None:
    folder = _copy(encoder_dir, tmp_path / "cut")
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    _cut(weights, 1000)
    with pytest.raises(UnsupportedModel) as refused:
        check_loadable(folder, Task.EMBED, RuntimeKind.TORCH, {})
    assert str(refused.value) == (
        f"{weights} holds {size - 1000:,} bytes where its header describes {size:,}: the file is cut short; "
        "copy the weights again"
    )
    with pytest.raises(Exception, match="incomplete metadata"):  # what the load would have said, as a 503
        load_runtime(ModelSource(folder, Task.EMBED))


def test_weights_longer_than_their_header_describes_are_refused(encoder_dir: Path, tmp_path: Path) -> None:
    folder = _copy(encoder_dir, tmp_path / "long")
    with (folder / "model.safetensors").open("ab") as weights:
        weights.write(b"\0" * 16)
    with pytest.raises(UnsupportedModel, match="the file is longer than its tensors"):
        check_loadable(folder, Task.EMBED, RuntimeKind.ONNX, {})  # exported from these weights: the same read


def test_a_git_lfs_pointer_in_place_of_the_weights_is_refused(encoder_dir: Path, tmp_path: Path) -> None:
    folder = _copy(encoder_dir, tmp_path / "pointer")
    (folder / "model.safetensors").write_bytes(LFS_POINTER)
    with pytest.raises(UnsupportedModel, match=r"model\.safetensors is not a safetensors file: its header cannot"):
        check_loadable(folder, Task.EMBED, RuntimeKind.TORCH, {})


def test_a_shard_the_index_names_must_be_there_and_whole(encoder_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModel

    folder = _copy(encoder_dir, tmp_path / "sharded")
    (folder / "model.safetensors").unlink()
    AutoModel.from_pretrained(encoder_dir).save_pretrained(folder, max_shard_size="1MB")
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    check_loadable(folder, Task.EMBED, RuntimeKind.TORCH, {})  # whole: it passes

    _cut(shards[-1], 10)
    with pytest.raises(UnsupportedModel, match=f"{shards[-1].name} holds .* the file is cut short"):
        check_loadable(folder, Task.EMBED, RuntimeKind.TORCH, {})
    shards[-1].unlink()
    with pytest.raises(UnsupportedModel, match=f"{shards[-1].name} is missing from {folder}; its weights index names"):
        check_loadable(folder, Task.EMBED, RuntimeKind.TORCH, {})


def test_an_adapter_whose_weights_are_cut_short_is_refused(adapter_dirs: dict[Task, Path], tmp_path: Path) -> None:
    folder = _copy(adapter_dirs[Task.CLASSIFY], tmp_path / "adapter")
    check_adapter_folder(folder, base_task=Task.CLASSIFY)
    _cut(folder / "adapter_model.safetensors", 4)
    with pytest.raises(UnsupportedModel, match=r"adapter_model\.safetensors holds .* the file is cut short"):
        check_adapter_folder(folder, base_task=Task.CLASSIFY)
