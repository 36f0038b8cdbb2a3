"""Tiny random-init checkpoints of each architecture, saved as Hugging Face folders by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 320


def _write_tokenizer(folder: Path) -> None:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))


def _config(kind: str):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if kind == "llama3-rope":
        return transformers.LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "mqa":
        return transformers.LlamaConfig(**{**common, "num_key_value_heads": 1})
    if kind == "mistral-window":
        return transformers.MistralConfig(**common, sliding_window=8, head_dim=16)
    if kind == "qwen2-yarn":
        return transformers.Qwen2Config(
            **common, rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 4},
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        )
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    if kind == "phi3":
        return transformers.Phi3Config(**common, tie_word_embeddings=False)
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=512, initializer_range=0.2,
            eos_token_id=None, bos_token_id=None,
        )  # fmt: skip
    if kind == "bloom":
        return transformers.BloomConfig(
            vocab_size=VOCAB, hidden_size=64, n_layer=3, n_head=4, initializer_range=0.2,
            eos_token_id=None, bos_token_id=None, pad_token_id=None,
        )  # fmt: skip
    raise ValueError(kind)


def make_tiny_model(kind: str, folder: Path) -> Path:
    """Create, save and return the folder of a tiny model of `kind`."""
    import transformers

    torch.manual_seed(0)
    config = _config(kind)
    cls = transformers.Gemma3ForCausalLM if kind == "gemma3" else transformers.AutoModelForCausalLM
    model = cls.from_config(config) if cls is transformers.AutoModelForCausalLM else cls(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return folder


def make_tiny_chat_model(folder: Path) -> Path:
    """A tiny llama with a chat template (messages' contents joined), so that chat routes can serve it."""
    make_tiny_model("llama", folder)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


def make_lora_adapter(base_folder: Path, folder: Path, seed: int, rank: int = 4) -> str:
    """A random PEFT LoRA adapter on every linear projection of the model at `base_folder` (B not zero,
    and larger than peft's init, so that it changes the outputs well above fp32 noise)."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = torch.randn_like(param) * 0.2
    model.save_pretrained(folder)
    return str(folder)


TINY_KINDS = ["llama", "llama3-rope", "mqa", "mistral-window", "qwen2", "qwen2-yarn", "gemma3"]
# Architectures added as one model file each (folio/models/): checked by the same oracle test.
NEW_ARCHITECTURE_KINDS = ["qwen3", "phi3", "gpt2", "bloom"]


# The catalog models' shapes (read from their GGUF files), for timing folio where their files cannot go:
# random weights multiply and attend exactly as much as trained ones.
FULL_SIZE_SHAPES = {
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True,
    ),
    "gemma3-270m": dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512,
        query_pre_attn_scalar=256, tie_word_embeddings=True,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
    ),
}  # fmt: skip


def make_full_size_model(name: str, folder: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A random-init checkpoint with catalog model `name`'s shapes, in `dtype`, and a word-level
    tokenizer over its whole vocabulary (ids "t0".."tN")."""
    import transformers

    torch.manual_seed(0)
    shape = dict(FULL_SIZE_SHAPES[name])
    config = transformers.AutoConfig.for_model(shape.pop("model_type"), **shape, eos_token_id=None,
                                               bos_token_id=None, pad_token_id=None)  # fmt: skip
    cls = transformers.Gemma3ForCausalLM if name.startswith("gemma3") else transformers.AutoModelForCausalLM
    model = cls(config) if cls is transformers.Gemma3ForCausalLM else cls.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder
