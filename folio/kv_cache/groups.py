"""KV cache groups: layers that share a block table.

Most models attend every layer over the whole context, and one block table serves them all: a block
holds `block_size` tokens of K/V for every layer. A model that mixes sliding-window and global layers
(Gemma 2 and 3) would then keep every block for its window layers too, which never look past the
window. As vLLM's hybrid allocator does, its layers are split into groups of equal size, each group all
window or all global, and each group has its own block table: a window group gives back the blocks
that fell out of its window, a global group keeps them. A block holds `layers_per_block` layers' K/V
(one from whichever group owns it), so every block is the same size and one pool serves all groups.

Gemma 3 270M: 18 layers, every sixth global. Groups of 3: the global layers (5, 11, 17) form one,
the window layers five more. A request within the window holds 6 blocks per 16 tokens, the same
memory as one table over 18 layers; past the window its window groups stop growing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window, None for global layers
    layer_group: tuple[int, ...]  # per layer: the group whose block table it reads
    layer_slot: tuple[int, ...]  # per layer: which of a block's `layers_per_block` parts holds its K/V
    layers_per_block: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    @property
    def drops_blocks(self) -> bool:
        """Whether some group slides, so blocks behind its window go back to the pool."""
        return any(w is not None for w in self.windows)


def one_group(num_layers: int, window: int | None = None) -> KVGroups:
    """Every layer in one table (`window`: when every layer slides through the same window)."""
    return KVGroups((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def plan_kv_groups(layer_windows: Sequence[int | None]) -> KVGroups:
    """Groups for layers with these windows (None: global). One kind of layer: one group. Mixed: groups of
    as many layers as the rarest kind has, in layer order within each kind (the last group of a kind may
    be short; its block's unused parts are the price of one block size)."""
    kinds = sorted(set(layer_windows), key=lambda w: -1 if w is None else w)
    if len(kinds) == 1:
        return one_group(len(layer_windows), kinds[0])
    size = min(sum(1 for w in layer_windows if w == kind) for kind in kinds)
    windows: list[int | None] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for kind in kinds:
        members = [i for i, w in enumerate(layer_windows) if w == kind]
        for start in range(0, len(members), size):
            for slot, layer in enumerate(members[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(kind)
    return KVGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), size)
