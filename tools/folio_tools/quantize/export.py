"""Writes a quantized model as a Hugging Face folder: config.json (with `quantization_config`), the
tokenizer, and model.safetensors with each quantized projection in the GPTQ, AWQ or NF4 layout under
the checkpoint's own (unfused) names, e.g. `model.layers.0.self_attn.q_proj.qweight`.

config.json comes from the architecture's own module (`Architecture.config_to_hf`, folio/models/).
A GGUF source has no config.json or tokenizer.json of its own: both are written from what folio read
out of the file, with the tensors in Hugging Face's conventions (q/k rows un-permuted, Gemma norms
without the +1), so the folder loads like any Hugging Face checkpoint.

The folder is written as a temporary sibling and renamed into place at the end: a run that is killed
or fails never leaves a folder at the output path that looks like a checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from folio.layers.linear import Linear, MergedLinear
from folio.loaders.tokenizer import Tokenizer
from folio.weight_formats.checkpoint_layouts import IntGroups, pack_awq, pack_gptq

DENSE_DTYPE = torch.float16  # embeddings (and biases), as GPTQ/AWQ checkpoints usually ship them
# Norm weights are tiny and stay float32: AWQ folds 1/s into them, and a Gemma norm stores w with the
# effective weight 1 + w, so (1 + w) / s - 1 for a large s would keep only a few bits in float16.
NORM_DTYPE = torch.float32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")  # fmt: skip


def write_tokenizer(tokenizer: Tokenizer, source: Path, output: Path) -> None:
    """Copy a Hugging Face folder's tokenizer files, or write them from a GGUF file's tokenizer."""
    if source.is_dir():
        for name in TOKENIZER_FILES:
            if (source / name).exists():
                shutil.copy(source / name, output / name)
        return
    tokenizer.backend.save(str(output / "tokenizer.json"))
    settings = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                "chat_template": tokenizer.chat_template}  # fmt: skip
    (output / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


def checkpoint_tensors(model: torch.nn.Module, stacked: list[tuple[str, str, object]],
                       quantized: dict[str, Any], layout: str) -> dict[str, torch.Tensor]:  # fmt: skip
    """Every tensor of the checkpoint: each quantized layer split back into its checkpoint names and
    packed in `layout` ("gptq", "awq" or "nf4"); every other parameter dense."""
    tensors: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name, weight in quantized.items():
        layer = modules[name]
        for shard_name, (offset, size) in _shards(name, layer, stacked):
            part = _rows(weight, offset, size)
            for key, value in _pack(part, layout).items():
                tensors[f"{shard_name}.{key}"] = value
            if layer.bias is not None:
                tensors[f"{shard_name}.bias"] = layer.bias.data[offset : offset + size].to(DENSE_DTYPE)
    skip = {f"{name}.{p}" for name in quantized for p in ("weight", "bias")}
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, param in model.named_parameters():
        if name in skip or (tied and name.startswith("lm_head.")) or param.numel() == 0:
            continue
        dtype = NORM_DTYPE if param.dim() == 1 else DENSE_DTYPE
        for shard_name, (offset, size) in _param_shards(name, param, modules, stacked):
            tensors[shard_name] = param.data[offset : offset + size].to(dtype).contiguous()
    return tensors


def _shards(name: str, layer: Linear, stacked: list[tuple[str, str, object]]) -> list[tuple[str, tuple[int, int]]]:
    """(checkpoint module name, (row offset, rows)) of each shard of a fused layer."""
    if not isinstance(layer, MergedLinear):
        return [(name, (0, layer.out_features))]
    fused = name.rsplit(".", 1)[-1]
    parts = {shard_id: part for f, part, shard_id in stacked if f == fused}
    if not parts:  # the checkpoint holds the fused layer itself (Phi-3's qkv_proj)
        return [(name, (0, layer.out_features))]
    return [(name[: -len(fused)] + parts[shard_id], rows) for shard_id, rows in layer.shard_offsets.items()]


def _param_shards(name: str, param: torch.Tensor, modules: dict[str, Any],
                  stacked: list) -> list[tuple[str, tuple[int, int]]]:  # fmt: skip
    module_name, _, kind = name.rpartition(".")
    layer = modules.get(module_name)
    if isinstance(layer, MergedLinear):
        return [(f"{shard}.{kind}", rows) for shard, rows in _shards(module_name, layer, stacked)]
    return [(name, (0, param.shape[0]))]


def _rows(weight: Any, offset: int, size: int) -> Any:
    if isinstance(weight, IntGroups):
        return IntGroups(weight.codes[offset : offset + size], weight.zeros[offset : offset + size],
                         weight.scales[offset : offset + size], weight.bits, weight.group_index)  # fmt: skip
    if tuple(weight.shape) == (size, weight.shape[1]) and offset == 0:
        return weight  # a layer of one checkpoint tensor
    return weight.rows(offset, size)  # one block of a ConcatRows


def _pack(weight: Any, layout: str) -> dict[str, torch.Tensor]:
    if layout == "gptq":
        return pack_gptq(weight)
    if layout == "awq":
        return pack_awq(weight)
    return weight.to_tensors()


@contextmanager
def staged_folder(output: Path) -> Iterator[Path]:
    """A fresh temporary sibling of `output` to write into, renamed to `output` when the block ends and
    removed if it raises. An existing empty `output` is replaced; a non-empty one is left alone."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp"))
    try:
        yield staging
        staging.chmod(0o755)  # mkdtemp makes it private; a checkpoint is plain data
        try:
            os.replace(staging, output)  # rename(2) replaces an empty folder, never a full one
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            raise FileExistsError(f"{output} exists and is not an empty folder; choose a new output") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_checkpoint(output: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], notes: dict[str, Any],
                     tokenizer: Tokenizer, tokenizer_source: Path) -> None:  # fmt: skip
    """The whole folder at once: safetensors, config.json, folio_quantize.json and the tokenizer files
    (`tokenizer_source`: the model the tokenizer was read from)."""
    with staged_folder(output) as staging:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "folio_quantize.json").write_text(json.dumps(notes, indent=2))
        write_tokenizer(tokenizer, tokenizer_source, staging)
