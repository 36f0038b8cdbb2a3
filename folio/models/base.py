"""What every causal LM shares: the LM head, logits, weight loading and access to its attention layers;
and the MLPs and decoder blocks several architectures share.

A concrete model names its `body` (embeddings, decoder layers, final norm: a `StagedBody`), how checkpoint
names and layouts map onto its own (`checkpoint_rename`), and how separate checkpoint tensors fuse into its
layers (`stacked_params`, e.g. ("qkv_proj", "q_proj", "q")); every parameter's own `weight_loader` then
copies its slice.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from folio.config import ModelConfig
from folio.distributed.tensor_parallel import current
from folio.kv_cache.groups import KVGroups
from folio.kv_cache.quant import KVFormat
from folio.layers.activation import get_activation, get_gated_activation
from folio.layers.attention.kv_tensors import LayerKV, allocate_layer_kv
from folio.layers.attention.layer import PagedAttention
from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.embedding import LMHead
from folio.layers.linear import default_weight_loader
from folio.layers.norm import LayerNorm
from folio.layers.parallel_linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from folio.layers.split_argmax import local_best, pick_best
from folio.layers.weight_narrowing import LazyWeight
from folio.models.staged import HeldElsewhere, StageCarry, StagedBody
from folio.weight_formats.int4 import Int4Groups
from folio.weight_formats.int8 import Int8Groups


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


class UngatedMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc_in = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc_out = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class LayerNormBlock(nn.Module):
    """The decoder block of the GPT-2 lineage (GPT-2, BLOOM): LayerNorm before attention and before an
    ungated MLP, biases on every projection, residuals around both. Each architecture brings its own
    attention (learned positions, ALiBi); the parameter names match the Llama family's where they can."""

    def __init__(self, config: ModelConfig, attention: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = UngatedMLP(config)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def layernorm_block_params(config: ModelConfig, embedding_extras: int) -> int:
    """A GPT-2-lineage model's parameter count: the token embedding (and an untied head) and
    `embedding_extras` (a position table, an embedding norm), then per layer two LayerNorms, q/k/v and
    output projections and the MLP, all with biases, then the final LayerNorm."""
    h, i = config.hidden_size, config.intermediate_size
    layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2) + embedding_extras
    return embeddings + config.num_layers * layer + 2 * h


StackedMapping = list[tuple[str, str, object]]  # (fused name, checkpoint name, shard id)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | Int4Groups | Int8Groups]],
    stacked: StackedMapping,
    skip_prefixes: tuple[str, ...] = (),
) -> set[str]:
    """Load every tensor; return the names of parameters that were filled."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.startswith(skip_prefixes) or "rotary_emb.inv_freq" in name:
            continue
        target, shard_id = _route(name, stacked)
        param = params.get(target)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        if isinstance(tensor, LazyWeight) and not getattr(param, "loads_slices", False):
            tensor = tensor.load()  # a loader that takes the whole tensor
        # Quantized groups go to the layer as they are; it keeps them or widens them itself.
        loader(param, tensor.to(param.dtype) if isinstance(tensor, torch.Tensor) else tensor, shard_id)
        loaded.add(target)
    return loaded


def _route(name: str, stacked: StackedMapping) -> tuple[str, object]:
    """Checkpoint name -> (parameter name, shard id); unfused names map to themselves."""
    for fused, part, shard_id in stacked:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def route_checkpoint_name(model: CausalLM, name: str, tensor: torch.Tensor) -> tuple[str, object]:
    """A Hugging Face checkpoint name -> (this model's parameter name, shard id), as its weights load (a LoRA
    adapter's matrices find their layer this way). A name the model drops routes to itself."""
    pair = model.checkpoint_rename(name, tensor)
    return _route(pair[0] if pair is not None else name, model.stacked_params)


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    # Tied parameters appear under two names; either one being loaded is enough.
    seen_ids = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in loaded}
    missing = [n for n, p in model.named_parameters() if id(p) not in seen_ids]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")


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


def gpt2_lineage_rename(
    model: str, top_names: dict[str, str], block_names: dict[str, str], conv1d: tuple[str, ...] = (),
    ignored: str | None = None,
) -> CheckpointRename:  # fmt: skip
    """Hugging Face's GPT-2-lineage names (GPT-2, BLOOM), `[transformer.]h.N.<part>.weight|bias` and
    `[transformer.]<top>.weight|bias`, onto folio's; the `conv1d` parts hold Conv1D weights ([in, out], the
    transpose of a Linear's); names matching the `ignored` pattern are no weights (skipped)."""
    block_re = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(.+)\.(weight|bias)$")
    top_re = re.compile(rf"^(?:transformer\.)?({'|'.join(top_names)})\.(weight|bias)$")

    def rename(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith("lm_head."):
            return name, tensor
        if top := top_re.match(name):
            return f"model.{top_names[top.group(1)]}.{top.group(2)}", tensor
        block = block_re.match(name)
        if block is None or block.group(2) not in block_names:
            if ignored is not None and re.search(ignored, name):
                return None
            raise KeyError(f"unexpected {model} checkpoint tensor {name!r}")
        layer, part, kind = block.groups()
        if part in conv1d and kind == "weight":
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{model} checkpoints with quantized Conv1D weights are not supported")
            tensor = tensor.t()
        return f"model.layers.{layer}.{block_names[part]}.{kind}", tensor

    return rename


class CausalLM(nn.Module):
    body: Callable[[ModelConfig], StagedBody]
    stacked_params: StackedMapping = QKV_GATE_UP
    # Hugging Face checkpoint name and layout -> this model's parameter name and layout.
    checkpoint_rename: CheckpointRename = staticmethod(keep_checkpoint_name)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.model = self.body(config)
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
            # Attention stays out of the graphs (the layer breaks there, as vLLM's piecewise graphs do):
            # traced, its branches on the step's metadata (group count, fresh prompts, cached masks) became
            # guards, and a few mixed steps spent the compiler's 8 recompiles, after which layers ran eager.
            # Wrapped here rather than decorated: the decorator imports torch._dynamo (~2 s) in every process.
            attention = layer.self_attn.attn
            attention.forward = torch.compiler.disable(attention.forward)
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
