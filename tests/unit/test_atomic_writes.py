"""Benchmark results and quantized checkpoints appear whole under their final name, or not at all: a
failure mid-write leaves neither a partial file or folder nor a stray temporary. No model is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from folio_tools import results
from folio_tools.quantize import export
from folio_tools.quantize.export import write_checkpoint
from folio_tools.results import save_figure, write_json
from safetensors.torch import load_file

RESULT = {"benchmark": "throughput", "results": {"folio": {"output_tokens_per_s": 12.5}}}


class NotJSON:
    """Deep in a result, so json.dump has written part of the file when it fails."""


def test_write_json_writes_the_whole_result(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    write_json(path, RESULT)
    assert json.loads(path.read_text()) == RESULT and path.read_text().endswith("}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_failed_json_write_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    with pytest.raises(TypeError, match="NotJSON"):
        write_json(path, {**RESULT, "zzz": [1, 2, NotJSON()]})
    assert list(tmp_path.iterdir()) == []


def test_failed_json_write_keeps_the_previous_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "result.json"
    write_json(path, RESULT)

    def dump_half(data: Any, f: Any, **kwargs: Any) -> None:
        f.write('{"benchmark": "thr')
        raise KeyboardInterrupt  # the benchmark killed mid-write

    monkeypatch.setattr(results.json, "dump", dump_half)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"benchmark": "other"})
    assert json.loads(path.read_text()) == RESULT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


class FakeFigure:
    """Stands in for a matplotlib figure: writes `payload`, then fails if told to."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[dict[str, Any]] = []

    def savefig(self, f: Any, **kwargs: Any) -> None:
        self.calls.append(kwargs)
        f.write(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
        if self.fail:
            raise OSError("disk full")


def test_save_figure_writes_the_png_under_its_final_name(tmp_path: Path) -> None:
    path = tmp_path / "result.png"
    fig = FakeFigure()
    save_figure(fig, path)
    assert fig.calls == [{"format": "png", "dpi": 110}]  # the format of the final name, not of the .tmp
    assert path.read_bytes().startswith(b"\x89PNG") and sorted(p.name for p in tmp_path.iterdir()) == ["result.png"]


def test_failed_figure_write_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="disk full"):
        save_figure(FakeFigure(fail=True), tmp_path / "result.png")
    assert list(tmp_path.iterdir()) == []


def test_save_figure_with_matplotlib(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1], [1, 0])
    save_figure(fig, tmp_path / "plot.png", dpi=20)
    plt.close(fig)
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


# -- quantized checkpoints -------------------------------------------------------------------------

TENSORS = {"model.embed_tokens.weight": torch.arange(12, dtype=torch.float16).reshape(3, 4)}
CONFIG = {"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "gptq", "bits": 4}}
NOTES = {"method": "int4", "group_size": 32}
CHECKPOINT_FILES = [
    "config.json",
    "folio_quantize.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture
def tokenizer_source(tmp_path: Path) -> Path:
    """A Hugging Face folder's tokenizer files (copied as they are; the tokenizer object is not used)."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer.json").write_text('{"model": {}}')
    (source / "tokenizer_config.json").write_text("{}")
    return source


def write(output: Path, source: Path) -> None:
    tokenizer: Any = SimpleNamespace()  # write_tokenizer copies a folder's files without touching it
    write_checkpoint(output, CONFIG, TENSORS, NOTES, tokenizer=tokenizer, tokenizer_source=source)


def test_checkpoint_folder_is_written_whole(tmp_path: Path, tokenizer_source: Path) -> None:
    output = tmp_path / "out" / "model-int4"
    write(output, tokenizer_source)
    assert sorted(p.name for p in output.iterdir()) == CHECKPOINT_FILES
    saved = load_file(str(output / "model.safetensors"))
    assert torch.equal(saved["model.embed_tokens.weight"], TENSORS["model.embed_tokens.weight"])
    assert json.loads((output / "config.json").read_text()) == CONFIG
    assert sorted(p.name for p in output.parent.iterdir()) == ["model-int4"]  # no temporary sibling left
    assert output.stat().st_mode & 0o777 == 0o755


def test_empty_output_folder_is_replaced(tmp_path: Path, tokenizer_source: Path) -> None:
    output = tmp_path / "model-int4"
    output.mkdir()  # `folio quantize --output` named a folder made beforehand
    write(output, tokenizer_source)
    assert (output / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-int4", "source"]


def test_full_output_folder_is_refused_and_left_alone(tmp_path: Path, tokenizer_source: Path) -> None:
    output = tmp_path / "model-int4"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="model-int4 exists and is not an empty folder") as info:
        write(output, tokenizer_source)
    assert "\n" not in str(info.value)
    assert [p.name for p in output.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-int4", "source"]


def test_failure_in_save_file_leaves_no_folder(
    tmp_path: Path, tokenizer_source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def save_half(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        Path(filename).write_bytes(b"\0" * 64)  # part of the safetensors file is on disk
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "save_file", save_half)
    output = tmp_path / "model-int4"
    with pytest.raises(KeyboardInterrupt):
        write(output, tokenizer_source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_failure_in_the_tokenizer_leaves_no_folder(
    tmp_path: Path, tokenizer_source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(tokenizer: Any, source: Path, output: Path) -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(export, "write_tokenizer", broken)
    output = tmp_path / "model-int4"
    output.mkdir()  # an empty folder given beforehand stays as it was
    with pytest.raises(OSError, match="no space left"):
        write(output, tokenizer_source)
    assert list(output.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["model-int4", "source"]
