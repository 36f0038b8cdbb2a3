"""`folio kv-calc`: KV bytes per token agree with what the engine allocates, parameter counts from
config agree with the tensors on disk, and the fits-in-memory arithmetic is right."""

from __future__ import annotations

import torch
from folio_tools.kv_calc import (
    KV_DTYPES,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    load_shape,
    params_from_config,
    window_tokens_held,
)

from folio.cli import main
from folio.worker.model_runner import kv_bytes_per_token as engine_kv_bytes
from tests.tiny_models import make_tiny_model


def test_per_token_bytes_match_the_engine(smollm2_gguf, gemma3_gguf):
    for path in (smollm2_gguf, gemma3_gguf):
        config = load_shape(path).config
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            assert kv_bytes_per_token(config, KV_DTYPES[name]) == engine_kv_bytes(config, dtype)


def test_config_estimate_equals_the_tensor_count(tmp_path):
    for kind in ("llama", "mqa", "qwen2"):
        folder = make_tiny_model(kind, tmp_path / kind)
        counted = load_shape(folder)
        assert counted.params_source == "tensors"
        bias = 0
        if kind == "qwen2":  # q/k/v biases are not in the llama-family estimate
            c = counted.config
            bias = c.num_layers * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        assert params_from_config(counted.config) + bias == counted.num_params
        bare = tmp_path / f"{kind}-config-only"
        bare.mkdir()
        (bare / "config.json").write_text((folder / "config.json").read_text())
        estimated = load_shape(bare / "config.json")
        assert estimated.params_source == "config" and estimated.num_params == counted.num_params - bias


def test_report_and_fit_arithmetic(smollm2_gguf, capsys):
    assert main(["kv-calc", str(smollm2_gguf), "--seq-len", "1000", "--batch", "2", "--kv-dtype", "bfloat16",
                 "--memory", "1GiB", "--weights", "Q4_0", "--mha"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    shape = load_shape(smollm2_gguf)
    per_token = kv_bytes_per_token(shape.config, 2)
    room = 2**30 - shape.num_params * 4.5 / 8
    assert f"{int(room // (per_token * 1000))} sequences of 1000 tokens" in out
    assert "3.0x as much" in out  # 9 query heads over 3 KV heads
    assert "22.5 KiB" in out and "43.9 MiB" in out  # 2 x 1000 tokens x 23,040 B


def test_bad_options_are_one_line(smollm2_gguf, capsys):
    assert main(["kv-calc", str(smollm2_gguf), "--kv-dtype", "int3"]) == 1
    assert capsys.readouterr().err.strip().startswith("folio: error: --kv-dtype must be one of")


def test_window_layers_are_capped_at_their_window(gemma3_gguf, capsys):
    assert main(["kv-calc", str(gemma3_gguf), "--seq-len", "256", "4096", "--batch", "1", "--memory", "1GiB",
                 "--weights", "Q4_K"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    # 1 KiB per layer and token in bf16; 4,096 tokens: 3 global layers whole, 15 window layers at 528 tokens.
    assert "15 of 18 layers slide through a 512-token window: decoding, each holds at most 528 tokens" in out
    assert "4.5 MiB" in out  # 256 tokens: within the window, every layer holds them all
    assert "19.7 MiB" in out  # (3 x 4,096 + 15 x 528) KiB
    config = load_shape(gemma3_gguf).config
    assert kv_bytes_per_sequence(config, 2, 4096) == 1024 * (3 * 4096 + 15 * window_tokens_held(512))
