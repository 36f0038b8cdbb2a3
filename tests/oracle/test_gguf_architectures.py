"""GGUF files of the architectures added as one model file (Qwen3, Phi-3), written from tiny random
transformers models the way llama.cpp's converter names them (gguf's own HF -> GGUF tensor name map),
give transformers' logits and greedy tokens: the architecture's GGUFLayout maps them back correctly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from folio.config import CacheConfig, SchedulerConfig
from folio.engine.engine_core import EngineCore
from folio.loaders.model_loader import load_model
from tests.engine_driver import run_greedy_capturing_logits
from tests.reference import reference_greedy
from tests.tiny_models import VOCAB, make_tiny_model

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

ARCHES = {"qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3}


def _write_gguf(kind: str, reference, path) -> None:
    config = reference.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    arch_name = gguf.MODEL_ARCH_NAMES[ARCHES[kind]]
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, VOCAB)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [1] * (VOCAB - 3))
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(3, VOCAB)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    names = gguf.get_tensor_name_map(ARCHES[kind], config.num_hidden_layers)
    for name, tensor in reference.state_dict().items():
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        writer.add_tensor(target, tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", sorted(ARCHES))
def test_gguf_file_matches_transformers(kind, tmp_path):
    folder = make_tiny_model(kind, tmp_path / kind)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = tmp_path / f"{kind}.gguf"
    _write_gguf(kind, reference, path)
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    assert loaded.config.architecture == type(reference).__name__
    engine = EngineCore(loaded.model, loaded.config, CacheConfig(block_size=4, num_blocks=64),
                        SchedulerConfig(max_num_batched_tokens=7, max_num_seqs=4, max_model_len=256),
                        torch.float32, torch.device("cpu"))  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (19, 4)]
    outputs, logits = run_greedy_capturing_logits(engine, prompts, 12)
    for prompt, output, folio_logits in zip(prompts, outputs, logits, strict=True):
        ref_tokens, ref_logits = reference_greedy(reference, prompt, 12)
        assert output == ref_tokens
        torch.testing.assert_close(folio_logits, ref_logits, atol=1e-4, rtol=0)
