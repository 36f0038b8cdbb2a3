"""`folio quantize` end to end on tiny Llama and Gemma 3 checkpoints.

The oracle: each written checkpoint is unpacked here by code written from the GPTQ / AWQ layout
descriptions (not folio's unpacker), saved as a plain float folder, and run by transformers. folio
loading the quantized folder (dequantized) must give transformers' logits; with its kernels, close to
them.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from folio import LLM
from folio.cli import main
from folio.layers.linear import Linear
from tests.engine_driver import run_greedy_capturing_logits
from tests.tiny_models import make_tiny_model

PROMPTS = [list(range(3, 40)), [7, 7, 9, 200, 31, 5, 18, 99, 100, 2]]
CALIBRATION = ["--calibration-samples", "4", "--calibration-length", "64"]


def _words_to_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., W] -> codes [..., W, 32 / bits], lowest bits first."""
    per_word = 32 // bits
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(unsigned >> (bits * i)) & (2**bits - 1) for i in range(per_word)], dim=-1)


def reference_gptq_weight(t: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """W [N, K] from qweight [K*bits/32, N] (packed along K), qzeros [G, N*bits/32] (packed along N,
    stored minus one), scales [G, N], g_idx [K]."""
    q = _words_to_codes(t["qweight"].t(), bits).reshape(t["qweight"].shape[1], -1)  # [N, K]
    z = _words_to_codes(t["qzeros"], bits).reshape(t["qzeros"].shape[0], -1) + 1  # [G, N]
    g = t["g_idx"].long()
    return ((q - z.t()[:, g]) * t["scales"].float().t()[:, g]).float()


def reference_awq_weight(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """W [N, K] from qweight [K, N/8] and qzeros [G, N/8], word position i holding column
    (0, 2, 4, 6, 1, 3, 5, 7)[i] of its eight, scales [G, N]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    unorder = [order.index(c) for c in range(8)]
    q = _words_to_codes(t["qweight"], 4)[..., unorder].reshape(t["qweight"].shape[0], -1)  # [K, N]
    z = _words_to_codes(t["qzeros"], 4)[..., unorder].reshape(t["qzeros"].shape[0], -1)  # [G, N]
    group = q.shape[0] // z.shape[0]
    z, s = z.repeat_interleave(group, 0), t["scales"].float().repeat_interleave(group, 0)
    return ((q - z) * s).t().float().contiguous()


def plain_folder(quantized, target, source):
    """A float copy of a quantized folder, the weights unpacked by the reference functions above."""
    config = json.loads((quantized / "config.json").read_text())
    quant = config.pop("quantization_config")
    tensors = load_file(str(quantized / "model.safetensors"))
    plain = {}
    for name, value in tensors.items():
        prefix, _, part = name.rpartition(".")
        if part == "qweight":
            parts = {p: tensors[f"{prefix}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")
                     if f"{prefix}.{p}" in tensors}  # fmt: skip
            if quant["quant_method"] == "awq":
                plain[f"{prefix}.weight"] = reference_awq_weight(parts)
            else:
                plain[f"{prefix}.weight"] = reference_gptq_weight(parts, quant["bits"])
        elif part not in ("qzeros", "scales", "g_idx"):
            plain[name] = value.float()
    target.mkdir()
    save_file(plain, str(target / "model.safetensors"))
    config["torch_dtype"] = "float32"
    (target / "config.json").write_text(json.dumps(config))
    (target / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    return target


def transformers_logits(folder, prompt):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def folio_logits(folder, **kwargs):
    llm = LLM(folder, num_kv_blocks=64, block_size=4, **kwargs)
    _, logits = run_greedy_capturing_logits(llm.engine, PROMPTS, 1)
    return llm, logits


@pytest.fixture
def random_calibration(monkeypatch):
    """The tiny models' word-level vocabulary maps ShareGPT text to one unknown token, which makes every
    calibration input alike; seeded random token windows exercise GPTQ and AWQ properly instead."""
    from folio_tools.eval import corpus

    def windows(encode, num_samples, length, seed=0):
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, 320, (num_samples, length), generator=generator).tolist()

    monkeypatch.setattr(corpus, "calibration_windows", windows)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("method", ["int8", "int4", "gptq", "awq"])
def test_quantized_checkpoints_equal_transformers_on_their_unpacked_weights(tmp_path, kind, method,
                                                                            random_calibration):  # fmt: skip
    source = make_tiny_model(kind, tmp_path / "source")
    out = tmp_path / "quantized"
    assert main(["quantize", str(source), "--method", method, "--output", str(out), *CALIBRATION]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == ("awq" if method == "awq" else "gptq")
    reference = plain_folder(out, tmp_path / "plain", source)

    dense_llm, dense = folio_logits(out, quantization="none")
    kept_llm, kept = folio_logits(out)
    assert kept_llm.loaded.weight_bytes < dense_llm.loaded.weight_bytes
    assert any(getattr(m, "packed", None) is not None for m in kept_llm.loaded.model.modules())
    for prompt, dense_rows, kept_rows in zip(PROMPTS, dense, kept, strict=True):
        expected = transformers_logits(reference, prompt)[: len(prompt)]
        torch.testing.assert_close(dense_rows[: len(prompt)], expected, atol=2e-4, rtol=1e-4)
        # Kept weights run through kernels with bf16 activations (and bf16 scales); the tiny random models'
        # large weights amplify that rounding to 0.5-4.5% of the largest logit.
        scale = expected.abs().max()
        assert (kept_rows[: len(prompt)] - expected).abs().max() <= 0.06 * scale


def test_nf4_checkpoint_loads_packed_and_equals_its_dequantized_self(tmp_path):
    source = make_tiny_model("llama", tmp_path / "source")
    out = tmp_path / "nf4"
    assert main(["quantize", str(source), "--method", "nf4", "--output", str(out)]) == 0
    dense_llm, dense = folio_logits(out, quantization="none")
    kept_llm, kept = folio_logits(out)
    assert kept_llm.loaded.quantization.startswith("folio_nf4")
    linears = [m for m in kept_llm.loaded.model.modules() if isinstance(m, Linear)]
    weights = sum(m.in_features * m.out_features for m in linears)
    assert sum(m.weight_nbytes for m in linears) <= weights * 4.2 / 8  # 4.13 bits per weight
    for dense_rows, kept_rows in zip(dense, kept, strict=True):
        torch.testing.assert_close(kept_rows, dense_rows, atol=1e-3, rtol=1e-3)


def test_quantize_refuses_bad_options_with_one_line(tmp_path, capsys):
    source = make_tiny_model("llama", tmp_path / "source")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("taken")
    assert main(["quantize", str(source), "--method", "int4", "--output", str(tmp_path / "full")]) == 1
    assert "not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quantize", str(source), "--method", "int3", "--output", str(tmp_path / "o")])
    # The tiny model's 64-wide inputs do not split into groups of 128: refused before any calibration.
    assert main(["quantize", str(source), "--method", "gptq", "--group-size", "128", "--output",
                 str(tmp_path / "g128")]) == 1  # fmt: skip
    assert "divisible by 128" in capsys.readouterr().err and not (tmp_path / "g128").exists()
    # Quantizing an already quantized folder on the fly is refused.
    out = tmp_path / "int8"
    assert main(["quantize", str(source), "--method", "int8", "--output", str(out)]) == 0
    with pytest.raises(ValueError, match="already quantized"):
        LLM(out, num_kv_blocks=16, quantization="int4")
