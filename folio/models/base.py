"""What every causal LM shares: the LM head, logits, weight loading and access to its attention layers.

A concrete model sets `self.model` (embeddings, decoder layers, final norm) before calling
`_finish_init`, and lists how checkpoint tensors fuse into its layers in `stacked_params`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from folio.config import ModelConfig
from folio.distributed.tensor_parallel import current
from folio.kv_cache.groups import KVGroups
from folio.kv_cache.quant import KVFormat
from folio.layers.activation import get_gated_activation
from folio.layers.attention.kv_tensors import LayerKV, allocate_layer_kv
from folio.layers.attention.layer import PagedAttention
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.embedding import LMHead
from folio.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear
from folio.layers.split_argmax import local_best, pick_best
from folio.models.staged import HeldElsewhere, StageCarry
from folio.models.weights import StackedMapping, check_all_loaded, load_named_weights


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear.even(config.hidden_size, {0: size, 1: size})
        self.down_proj = RowParallelLinear(size, config.hidden_size)
        self.act = get_gated_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


# Separate q/k/v and gate/up checkpoint tensors stacked into qkv_proj and gate_up_proj.
QKV_GATE_UP: StackedMapping = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


CheckpointRename = Callable[[str, torch.Tensor], tuple[str, torch.Tensor] | None]  # None: not a weight, skip it


def keep_checkpoint_name(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    return name, tensor


class CausalLM(nn.Module):
    stacked_params: StackedMapping = QKV_GATE_UP
    # Hugging Face checkpoint name and layout -> this model's parameter name and layout.
    checkpoint_rename: CheckpointRename = staticmethod(keep_checkpoint_name)
    model: nn.Module

    def _finish_init(self, config: ModelConfig) -> None:
        self.config = config
        self.tp = current()  # the group the layers were built for
        self.stage = self.model.stage  # the pipeline stage it was built for
        # A last stage that is not the first holds the tied embedding's rows as its own head.
        tied = self.model.embed_tokens if config.tie_word_embeddings and self.stage.is_first else None
        self.lm_head: nn.Module = (
            LMHead(config.vocab_size, config.hidden_size, tied_to=tied) if self.stage.is_last else HeldElsewhere()
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        carried: StageCarry | None = None,
    ) -> torch.Tensor | StageCarry:  # fmt: skip
        """The final hidden states; on a pipeline stage before the last, what the next one continues from."""
        return self.model(input_ids, positions, meta, carried)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._soft_capped(self.lm_head(hidden).float())

    def greedy_tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's argmax of `compute_logits(hidden)` [N], and whether the row's logits were all
        finite [N] bool, without gathering a split vocabulary: each rank takes its range's best, and
        the ranks exchange three numbers a row instead of N x V / ranks logits."""
        if self.config.final_logit_softcapping:  # tanh can tie values the head tells apart: pick after it
            mine = local_best(self._soft_capped(self.lm_head.transient_logits(hidden)), self.lm_head.source.first_row)
        else:
            mine = self.lm_head.greedy_best(hidden)
        every = self.tp.all_gather_last(mine).view(-1, self.tp.size, 3)
        return pick_best(every)

    def _soft_capped(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def bind_decode_stack(self, dtype: torch.dtype) -> None:
        """Once the KV cache is bound: set up a compiled decode step if the model has one."""

    def compile_layers(self) -> None:
        """torch.compile each held decoder layer in place (shapes dynamic: every step's token count differs).
        The C++ kernels a layer calls are opaque to the compiler, so it compiles what lies between them."""
        for layer in self.model.held_layers():
            layer.compile(dynamic=True)

    @property
    def has_compiled_decode_step(self) -> bool:
        """Whether the C++ decode step serves this model's decodes (set up when the KV cache is bound)."""
        return getattr(self.model, "decode_stack", None) is not None

    def attention_layers(self) -> list[PagedAttention]:
        """This stage's (every layer's, for a whole model)."""
        return [layer.self_attn.attn for layer in self.model.held_layers()]

    def bind_kv_cache(
        self,
        num_slots: int,
        block_size: int,
        dtype: torch.dtype,
        fmt: KVFormat | None,
        device: torch.device,
        groups: KVGroups | None = None,
    ) -> list[LayerKV]:
        """Give every attention layer its slice of a paged KV cache of `num_slots` tokens, load the
        weight kernels (now, so that start-up builds or reports them, not a request), and set up the
        decode step that needs the cache bound. Returns each layer's K/V. With several KV cache `groups`
        a block holds `groups.layers_per_block` layers' K/V: the layers of one slot share its tensors,
        each reading them through its own group's block table."""
        layers = self.attention_layers()
        caches: list[LayerKV] = []
        if groups is None or not groups.is_hybrid:
            for layer in layers:
                layer_kv = allocate_layer_kv(num_slots, layer.num_kv_heads, layer.head_dim, dtype, fmt, device)
                layer.bind_cache(layer_kv, block_size)
                caches.append(layer_kv)
        else:
            if groups.num_layers != len(layers) or len({(a.num_kv_heads, a.head_dim) for a in layers}) != 1:
                raise ValueError("KV cache groups need every layer held here, all with one K/V shape")
            shared = [allocate_layer_kv(num_slots, layers[0].num_kv_heads, layers[0].head_dim, dtype, fmt, device)
                      for _ in range(groups.layers_per_block)]  # fmt: skip
            for index, layer in enumerate(layers):
                layer_kv = shared[groups.layer_slot[index]]
                layer.bind_cache(layer_kv, block_size, groups.layer_group[index])
                caches.append(layer_kv)
        for module in self.modules():
            if (packed := getattr(module, "packed", None)) is not None:
                packed.load_kernels()
        if isinstance(self.lm_head, LMHead):
            self.lm_head.prepare_greedy()
        self.bind_decode_stack(dtype)
        return caches

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.config.tie_word_embeddings
        # Parts other pipeline stages hold: their tensors are skipped unread (a lazy GGUF tensor never is).
        elsewhere = tuple(f"{name}." for name, module in self.named_modules() if isinstance(module, HeldElsewhere))
        head_owns_embedding = tied and self.stage.is_last and not self.stage.is_first
        rename = self.checkpoint_rename

        def renamed_pairs() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                pair = rename(name, tensor)
                if pair is None or (tied and pair[0].startswith("lm_head.")):  # the embedding is the head
                    continue
                if head_owns_embedding and pair[0].startswith("model.embed_tokens."):
                    pair = pair[0].replace("model.embed_tokens.", "lm_head.", 1), pair[1]
                yield pair

        loaded = load_named_weights(self, renamed_pairs(), self.stacked_params, skip_prefixes=elsewhere)
        check_all_loaded(self, loaded)
