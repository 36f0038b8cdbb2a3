"""What an architecture declares about itself, in its own module: `ARCHITECTURE = Architecture(...)`.

The registry (registry.py) collects these from the model modules; the loaders, `folio quantize` and
`folio kv-calc` read everything architecture-specific from them: how config.json and GGUF metadata
become a `ModelConfig` (and a `ModelConfig` becomes config.json again), how checkpoint tensor names
map onto the model's parameters, which checkpoint tensors fuse into one layer, the GGUF vocabulary's
family, and whether the C++ decode step (decode_stack.py) serves the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from folio.config import ModelConfig
from folio.models.base import CausalLM

HFConfig = dict[str, Any]  # a parsed config.json


class GGUFMetadata(Protocol):
    """What an architecture reads from a GGUF file (loaders/gguf_file.py's GGUFFile is one)."""

    tensors: Mapping[str, Any]

    @property
    def architecture(self) -> str: ...

    def get(self, key: str, default: Any = None) -> Any: ...

    def arch_get(self, key: str, default: Any = None) -> Any: ...


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp stores the architecture: metadata, tensor names, and the conversions its converter
    applied that folio undoes (tensors come out under their Hugging Face names and conventions)."""

    names: tuple[str, ...]  # `general.architecture` values, e.g. ("llama",)
    config_from_gguf: Callable[[GGUFMetadata], ModelConfig]
    block_names: Mapping[str, str]  # "attn_q" (in blk.N.attn_q.weight) -> "self_attn.q_proj"
    top_names: Mapping[str, str]  # "token_embd" -> "model.embed_tokens"
    layer_prefix: str = "model.layers"  # Hugging Face prefix of block N: "<prefix>.N.<block name>"
    permuted_rope_rows: bool = False  # q/k rows interleaved for GGML's RoPE (llama.cpp's Llama converter)
    norm_offset: float = 0.0  # added to every norm weight by the converter (Gemma's 1 + w)


@dataclass(frozen=True)
class Architecture:
    name: str  # short name, e.g. "llama"
    hf_names: tuple[str, ...]  # config.json "architectures" values it runs, e.g. ("LlamaForCausalLM",)
    model_class: type[CausalLM]
    config_from_hf: Callable[[HFConfig], ModelConfig]
    config_to_hf: Callable[[ModelConfig], HFConfig]  # config.json for a checkpoint folio writes
    gguf: GGUFLayout | None = None  # None: no GGUF support
    # The family of a GGUF SentencePiece vocabulary ("llama" or "gemma": loaders/gguf_tokenizer.py).
    tokenizer_family: str = "llama"
    # The C++ decode step (decode_stack.py) serves it: the model class overrides bind_decode_stack.
    decode_stack: bool = False
    # Parameter count from the config alone (`folio kv-calc` on a bare config.json); None: the
    # Llama layout's estimate (kv_calc.params_from_config).
    estimate_params: Callable[[ModelConfig], int] | None = None
    # config.json architecture names this module knows and refuses, with the reason shown to the user.
    hf_refused: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        binds = self.model_class.bind_decode_stack is not CausalLM.bind_decode_stack
        if binds != self.decode_stack:
            verb = "binds" if binds else "does not bind"
            raise ValueError(f"{self.name}: decode_stack={self.decode_stack} but its model class {verb} one")
