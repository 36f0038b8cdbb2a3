"""How folio lays out the machine's memory.

**The heap.** Large allocations served from the heap and reused, not mapped afresh each time
(glibc's `mallopt`).

A step's large tensors are past glibc's mmap threshold, which is at most 32 MB (64 rows of Gemma 3's
262,144 logits are 67 MB, and the sampler makes a few more of that size). Each is then mapped afresh,
every page faults in as it is first written (~15 ms for 67 MB on this machine), and it is unmapped when
freed, so the next step pays again. With mmap off, such a block comes from the heap and, once freed,
serves the next step's without a fault: gemma3 sampling 64 requests ran 19-37% faster. The trim
threshold bounds what the heap keeps free at its top (256 MB); below it, freed blocks stay for reuse, as
tcmalloc (which vLLM's CPU images preload) keeps them. The engine asks once its model and KV pool are
loaded, so that loading's transients were mapped and given back.

**Weight arenas.** A loaded model's CPU weights moved into a few large arenas backed by 2 MiB pages.

Decode reads every weight once per step. Held as hundreds of separate allocations in 4 KiB pages, a
step's weights span ~23,000 pages for a 135M-parameter 4-bit model, and each page's first touch in a
step walks the page table. With 2 MiB pages that is ~50 walks. Measured on a 2-core Zen 3, interleaved:
the layers' 4-bit dot products ran ~3% faster (docs/benchmarks.md). Linux backs 2 MiB-aligned anonymous
memory with huge pages where it is advised to (MADV_HUGEPAGE; THP's default "madvise" mode), so each
weight is copied into an arena advised before its first touch, in the order the model declares it (the
order a step reads it), and every tensor that held the old memory now views the arena, its Python
object and any C++ holder unchanged (`tensor.data = view`).

Arenas are at most ARENA_BYTES each (a larger weight gets its own), so the copy never holds more than
one arena beside the weights it replaces. Where madvise is missing or refused (another OS, THP off),
the arenas are still one contiguous run per ~256 MiB, and nothing else changes.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
M_MMAP_MAX = -4
KEPT_FREE_AT_TOP = 256 << 20


def reuse_large_allocations() -> bool:
    """Turn glibc's mmap of large blocks off and bound its trimming; False where the C library has no
    mallopt (not glibc: macOS, musl's stub) or refuses it."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, KEPT_FREE_AT_TOP) == 1


HUGE_PAGE = 2 << 20
ARENA_BYTES = 256 << 20
ALIGN = 64  # every weight starts on a cache line (and so on its element size)
MADV_HUGEPAGE = 14  # linux/mman.h


@dataclass(frozen=True)
class ArenaReport:
    spans: tuple[tuple[int, int], ...]  # each arena's (address, length in bytes)
    bytes: int  # of weights moved
    advised: bool  # the kernel took MADV_HUGEPAGE for every arena

    def describe(self) -> str:
        pages = "2 MiB pages advised" if self.advised else "huge pages not available"
        return f"weights gathered into {len(self.spans)} arena(s), {self.bytes / 2**20:.1f} MiB ({pages})"


def _advise_huge_pages(address: int, length: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0


def _new_arena(nbytes: int) -> tuple[torch.Tensor, bool]:
    """An untouched uint8 buffer of `nbytes` starting on a huge-page boundary, and whether it was
    advised. A fresh allocation this large is mapped, not yet faulted in: the advice precedes every page."""
    length = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    raw = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    arena = raw[skip : skip + length]
    return arena, _advise_huge_pages(arena.data_ptr(), length)


def _is_folio_object(value: object) -> bool:
    """One of folio's own plain objects (not a module: the walk visits those itself)."""
    ours = type(value).__module__.startswith("folio.")
    return ours and not isinstance(value, nn.Module) and hasattr(value, "__dict__")


def _tensors_of(value: object, seen: set[int]) -> Iterator[torch.Tensor]:
    """Tensors held by `value`: itself, a list's or tuple's items, or the attributes of one of folio's
    own objects (a packed weight's tiles and scales; a ConcatRows' parts)."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_of(item, seen)
    elif _is_folio_object(value):
        for item in vars(value).values():
            yield from _tensors_of(item, seen)


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model's modules hold, each once, in declaration order: parameters, buffers and
    plain tensor attributes, and those of its packed weights."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    for module in model.modules():
        held = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        held += [value for name, value in vars(module).items() if not name.startswith("_")]
        for value in held:
            found.extend(_tensors_of(value, seen))
    return found


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def _arenas_of(storages: dict[int, torch.UntypedStorage]) -> list[list[int]]:
    """The storages' keys in order, cut into runs of at most ARENA_BYTES (a larger storage alone)."""
    arenas: list[list[int]] = [[]]
    filled = 0
    for key, storage in storages.items():
        if arenas[-1] and filled + storage.nbytes() > ARENA_BYTES:
            arenas.append([])
            filled = 0
        arenas[-1].append(key)
        filled += _aligned(storage.nbytes())
    return arenas


def _movable(tensor: torch.Tensor) -> bool:
    """A CPU tensor in memory torch allocated. Memory it was lent (`torch.frombuffer` over another
    process's shared memory, as tensor-parallel ranks reduce through, or over a mapped file) is not
    torch's to move, and its storage says so: it cannot be resized."""
    return tensor.device.type == "cpu" and tensor.numel() > 0 and tensor.untyped_storage().resizable()


def gather_weights(model: nn.Module) -> ArenaReport | None:
    """Move the CPU tensors of `model` that torch allocated into huge-page arenas; None when it holds
    none."""
    tensors = [t for t in model_tensors(model) if _movable(t)]
    storages: dict[int, torch.UntypedStorage] = {}
    users: dict[int, list[torch.Tensor]] = {}
    for tensor in tensors:  # tensors sharing memory (views, tied weights) move together
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        storages.setdefault(key, storage)
        users.setdefault(key, []).append(tensor)
    if not storages:
        return None
    advised, total, spans = True, 0, []
    with torch.no_grad():
        for keys in _arenas_of(storages):
            sizes = [_aligned(storages[k].nbytes()) for k in keys]
            arena, took = _new_arena(sum(sizes))
            advised &= took
            spans.append((arena.data_ptr(), arena.numel()))
            offset = 0
            for key, size in zip(keys, sizes, strict=True):
                storage = storages.pop(key)
                nbytes = storage.nbytes()
                arena[offset : offset + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
                for tensor in users.pop(key):
                    moved = arena[offset : offset + nbytes].view(tensor.dtype)  # as_strided's offset is the storage's
                    start = moved.storage_offset() + tensor.storage_offset()
                    tensor.data = moved.as_strided(tensor.shape, tensor.stride(), start)
                offset += size
                total += nbytes
    return ArenaReport(spans=tuple(spans), bytes=total, advised=advised)
