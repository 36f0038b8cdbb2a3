"""Each model module's Architecture: config.json read back from what it writes, the registry's look-ups,
and ALiBi slopes equal to transformers' for any head count."""

from __future__ import annotations

import pytest
import torch
from folio_tools.kv_calc import load_shape

from folio.layers.attention.alibi import alibi_slopes
from folio.loaders.hf_folder import read_hf_config
from folio.models.registry import all_architectures, architecture_named, config_from_hf, gguf_architecture
from tests.tiny_models import NEW_ARCHITECTURE_KINDS, TINY_KINDS, make_tiny_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", TINY_KINDS + NEW_ARCHITECTURE_KINDS)
def test_config_json_written_from_a_config_reads_back_the_same(kind, tmp_path):
    config = read_hf_config(make_tiny_model(kind, tmp_path / kind))
    architecture = architecture_named(config.architecture)
    assert config_from_hf(architecture.config_to_hf(config)) == config


def test_every_architecture_is_found_by_its_names():
    architectures = all_architectures()
    assert {"llama", "qwen2", "mistral", "gemma3", "qwen3", "phi3", "gpt2", "bloom"} <= {a.name for a in architectures}
    for architecture in architectures:
        for name in architecture.hf_names:
            assert architecture_named(name) is architecture
        for name in architecture.gguf.names if architecture.gguf else ():
            assert gguf_architecture(name) is architecture


def test_unknown_and_refused_architectures_are_named_errors():
    with pytest.raises(ValueError, match="'FalconForCausalLM' is not supported; folio runs .*GPT2LMHeadModel"):
        architecture_named("FalconForCausalLM")
    with pytest.raises(ValueError, match="multimodal Gemma 3"):
        architecture_named("Gemma3ForConditionalGeneration")
    with pytest.raises(ValueError, match="GGUF architecture 'falcon' is not supported"):
        gguf_architecture("falcon")


@pytest.mark.parametrize("num_heads", range(1, 17))
def test_alibi_slopes_equal_transformers(num_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    reference = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]  # slope * position 1
    torch.testing.assert_close(alibi_slopes(num_heads), reference)


@pytest.mark.parametrize("kind", ["gpt2", "bloom"])
def test_kv_calc_estimate_from_a_bare_config_equals_the_tensor_count(kind, tmp_path):
    folder = make_tiny_model(kind, tmp_path / kind)
    counted = load_shape(folder)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    estimated = load_shape(bare / "config.json")
    assert (counted.params_source, estimated.params_source) == ("tensors", "config")
    assert estimated.num_params == counted.num_params
