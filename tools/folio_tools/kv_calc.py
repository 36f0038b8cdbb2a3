"""`folio kv-calc`: how much memory a model's KV cache and weights take, and how many sequences fit.

KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element. Grouped-query
and multi-query attention store each KV head once, which is what `--mha` shows the saving of. A layer
that slides through a window holds at most the window and the block being written while it decodes
(its blocks behind the window go back to the pool: kv_cache/manager.py). Only the model's config is
read (GGUF metadata, or config.json); parameter counts come from the tensor
directory of a GGUF file or the safetensors headers when there are any, else from the config.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from folio.config import CacheConfig, ModelConfig
from folio.kv_cache.manager import window_blocks_held
from folio.loaders.gguf_file import GGUFFile
from folio.loaders.gguf_model import gguf_model_config
from folio.loaders.hf_folder import read_hf_config
from folio.models.registry import architecture_of

# Bits per weight of storage formats, scales included (GGUF block layouts; int8/int4 with one fp16
# scale per row / per group of 128).
WEIGHT_FORMATS: dict[str, float] = {
    "F32": 32.0, "BF16": 16.0, "F16": 16.0, "Q8_0": 8.5, "int8": 8.0, "Q6_K": 6.5625, "Q5_K": 5.5,
    "Q5_0": 5.5, "Q4_K": 4.5, "Q4_1": 5.0, "Q4_0": 4.5, "int4": 4.125,
}  # fmt: skip
KV_DTYPES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "int8": 1.0}
SCALED_KV_DTYPES = ("fp8", "int8")  # folio stores a float16 scale per token and KV head with them


def kv_element_bytes(kv_dtype: str, head_dim: int) -> float:
    """Bytes per cached K or V element, the 8-bit formats' per-row scale spread over the row."""
    return KV_DTYPES[kv_dtype] + (2 / head_dim if kv_dtype in SCALED_KV_DTYPES else 0.0)


@dataclass(frozen=True)
class ModelShape:
    config: ModelConfig
    num_params: int
    params_source: str  # "tensors" (counted from the files) or "config" (estimated)


BLOCK_SIZE = CacheConfig.block_size  # the engine's default


def kv_bytes_per_token(config: ModelConfig, kv_dtype_bytes: float, mha: bool = False) -> float:
    kv_heads = config.num_heads if mha else config.num_kv_heads
    return 2 * config.num_layers * kv_heads * config.head_dim * kv_dtype_bytes


def window_tokens_held(window: int) -> int:
    """The most tokens a window layer holds while decoding (one token a step), in whole blocks."""
    return window_blocks_held(window, 1, BLOCK_SIZE) * BLOCK_SIZE


def kv_bytes_per_sequence(config: ModelConfig, kv_dtype_bytes: float, seq_len: int, mha: bool = False) -> float:
    """What one sequence of `seq_len` tokens holds while decoding, its window layers capped."""
    per_layer_token = kv_bytes_per_token(config, kv_dtype_bytes, mha) / config.num_layers
    held = sum(seq_len if w is None else min(seq_len, window_tokens_held(w)) for w in config.layer_windows)
    return per_layer_token * held


def params_from_config(config: ModelConfig) -> int:
    """Llama-family layout: embeddings, attention, gated MLP, norms, and an LM head unless tied."""
    h, d = config.hidden_size, config.head_dim
    attention = h * config.num_heads * d * 2 + h * config.num_kv_heads * d * 2
    mlp = 3 * h * config.intermediate_size
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_layers * (attention + mlp + 2 * h) + h


def load_shape(path: Path) -> ModelShape:
    """A .gguf file, a Hugging Face folder, or a config.json file."""
    if path.suffix == ".gguf":
        gguf = GGUFFile(path)
        count = sum(t.num_elements for t in gguf.tensors.values())
        return ModelShape(gguf_model_config(gguf), count, "tensors")
    folder = path.parent if path.is_file() else path
    config = read_hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return ModelShape(config, sum(_safetensors_params(f) for f in files), "tensors")
    estimate = architecture_of(config).estimate_params or params_from_config
    return ModelShape(config, estimate(config), "config")


def _safetensors_params(path: Path) -> int:
    """Parameters in a safetensors file, read from its JSON header only."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    total = 0
    for name, info in header.items():
        if name != "__metadata__":
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
    return total


def format_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def report(
    shape: ModelShape,
    seq_lens: list[int],
    batches: list[int],
    kv_dtype: str,
    memory: int | None,
    weight_format: str,
    mha: bool = False,
) -> str:
    config = shape.config
    kv_bytes = kv_element_bytes(kv_dtype, config.head_dim)
    per_token = kv_bytes_per_token(config, kv_bytes)
    lines = [
        f"{config.architecture}: {config.num_layers} layers, {config.num_heads} query heads, "
        f"{config.num_kv_heads} KV heads, head dim {config.head_dim}, context {config.max_position_embeddings}",
        f"KV cache per token ({kv_dtype}): 2 x {config.num_layers} x {config.num_kv_heads} x {config.head_dim} x "
        f"{kv_bytes:g} B = {format_bytes(per_token)}"
        + (" (8-bit codes + a 2-byte scale per token and head)" if kv_dtype in SCALED_KV_DTYPES else ""),
    ]
    if mha:
        full = kv_bytes_per_token(config, kv_bytes, mha=True)
        lines.append(f"  without GQA/MQA ({config.num_heads} KV heads): {format_bytes(full)} per token, "
                     f"{full / per_token:.1f}x as much")  # fmt: skip
    windows = [w for w in config.layer_windows if w is not None]
    if windows:
        lines.append(
            f"  {len(windows)} of {config.num_layers} layers slide through a {windows[0]}-token window: decoding, "
            f"each holds at most {window_tokens_held(windows[0])} tokens (blocks of {BLOCK_SIZE}; a split model or "
            "--no-hybrid-kv-cache keeps every block of a model that also has global layers)"
        )
    lines.append("")
    lines.append("KV cache for batch x sequence length:")
    lines.append("  batch \\ seq " + "".join(f"{s:>12}" for s in seq_lens))
    for batch in batches:
        sizes = [kv_bytes_per_sequence(config, kv_bytes, s) * batch for s in seq_lens]
        lines.append(f"  {batch:>11} " + "".join(f"{format_bytes(size):>12}" for size in sizes))
    lines.append("")
    lines.append(f"Weights ({shape.num_params / 1e6:.1f}M parameters, counted from {shape.params_source}):")
    for name, bits in WEIGHT_FORMATS.items():
        lines.append(f"  {name:>5}: {format_bytes(shape.num_params * bits / 8)}")
    if memory is not None:
        weights = shape.num_params * WEIGHT_FORMATS[weight_format] / 8
        room = memory - weights
        lines.append("")
        lines.append(f"In {format_bytes(memory)} with {weight_format} weights ({format_bytes(weights)}):")
        if room <= 0:
            lines.append("  the weights alone do not fit")
        for seq in seq_lens:
            fits = int(max(room, 0) // kv_bytes_per_sequence(config, kv_bytes, seq))
            line = f"  {fits} sequences of {seq} tokens"
            if mha:
                line += f" ({int(max(room, 0) // kv_bytes_per_sequence(config, kv_bytes, seq, True))} without GQA/MQA)"
            lines.append(line)
    return "\n".join(lines)
