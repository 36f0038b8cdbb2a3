"""Hugging Face model folders: config.json and memory-mapped *.safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from folio.config import ModelConfig


def read_hf_config(folder: Path) -> ModelConfig:
    raw: dict[str, Any] = json.loads((folder / "config.json").read_text())
    if "text_config" in raw and raw.get("model_type") == "gemma3":
        raise ValueError("multimodal Gemma 3 checkpoints are not supported; use a text-only (Gemma3ForCausalLM) one")
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError(f"{folder}/config.json names no architecture")
    num_heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    is_gemma3 = architectures[0] == "Gemma3ForCausalLM"
    sliding_window, layer_types = None, None
    if is_gemma3:
        sliding_window, layer_types = raw.get("sliding_window"), _gemma3_layer_types(raw)
    elif raw.get("sliding_window") and raw.get("use_sliding_window", architectures[0] == "MistralForCausalLM"):
        # Mistral v0.1 (and Qwen2 with use_sliding_window) limit every layer to a window.
        sliding_window, layer_types = raw["sliding_window"], ["sliding_attention"] * raw["num_hidden_layers"]
    rope_theta, rope_scaling, rope_local_theta = _rope_settings(raw, is_gemma3)
    return ModelConfig(
        architecture=architectures[0],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", is_gemma3),
        attention_bias=raw.get("attention_bias", architectures[0] == "Qwen2ForCausalLM"),
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act", "silu"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=sliding_window,
        layer_types=layer_types,
        rope_local_theta=rope_local_theta,
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )


def _rope_settings(raw: dict[str, Any], is_gemma3: bool) -> tuple[float, dict | None, float | None]:
    """(rope_theta, scaling of global layers, theta of local layers); handles old and new config styles."""
    params = raw.get("rope_parameters")
    if params and is_gemma3 and "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention", {})
        return full.get("rope_theta", 1e6), _scaling_or_none(full), local.get("rope_theta", 10000.0)
    if params:
        return params.get("rope_theta", 10000.0), _scaling_or_none(params), None
    theta = raw.get("rope_theta", 10000.0)
    local = raw.get("rope_local_base_freq", 10000.0) if is_gemma3 else None
    return theta, raw.get("rope_scaling"), local


def _scaling_or_none(params: dict[str, Any]) -> dict[str, Any] | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    return None if rope_type == "default" else dict(params)


def _gemma3_layer_types(raw: dict[str, Any]) -> list[str]:
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(raw["num_hidden_layers"])
    ]


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, handle.get_tensor(name)
