"""Values that cross between ranks: msgpack (msgspec), read back as the type the receiver names.

A rank's messages used to be pickled, and unpickling runs whatever the bytes say: a fake rank that joined
first ran code on the others. Here a peer's bytes can only become the dataclasses the receiver asks for
(msgspec builds them field by field, typed) and tensors of a fixed set of dtypes. The sizes that precede
each payload are tensors too, so nothing a peer sends is ever executed.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import torch
import torch.distributed as dist

T = TypeVar("T")

# What a tensor or a dtype may be on the wire; anything else is refused when read.
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                     torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                     torch.bool)}  # fmt: skip


def _to_wire(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape),
                tensor.reshape(-1).view(torch.uint8).numpy().tobytes()]  # fmt: skip
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise NotImplementedError(f"{type(value).__name__} does not cross between ranks")


def _dtype(name: Any) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"not a dtype that crosses between ranks: {name!r}")
    return DTYPES[name]


def _from_wire(kind: type, value: Any) -> Any:
    if kind is torch.dtype:
        return _dtype(value)
    if kind is torch.Tensor:
        if not (isinstance(value, list) and len(value) == 3 and isinstance(value[1], list)
                and isinstance(value[2], bytes)):  # fmt: skip
            raise ValueError("a tensor is [dtype, shape, bytes]")
        return _as_tensor(value[2]).view(_dtype(value[0])).reshape(value[1])  # raises if the bytes do not fit
    raise NotImplementedError(f"{kind} does not cross between ranks")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_to_wire)


def encode(value: Any) -> bytes:
    return _ENCODER.encode(value)


def decoder(kind: type[T] | Any) -> msgspec.msgpack.Decoder:
    """A reader of `kind` (a dataclass, or a type expression such as `tuple[int, str] | None`)."""
    return msgspec.msgpack.Decoder(kind, dec_hook=_from_wire)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _payload(size: torch.Tensor) -> torch.Tensor:
    return torch.empty(int(size.item()), dtype=torch.uint8)


def receive(read: msgspec.msgpack.Decoder, src: int, group: Any) -> Any:
    """One value from rank `src`: its size, then its bytes, read as `read`'s type."""
    size = torch.empty(1, dtype=torch.long)
    dist.recv(size, src, group=group)
    data = _payload(size)
    dist.recv(data, src, group=group)
    return read.decode(data.numpy().tobytes())


def broadcast(value: Any, read: msgspec.msgpack.Decoder, src: int, group: Any) -> Any:
    """`value` from rank `src` to every rank of `group` (the others pass anything): each gets it back typed."""
    mine = dist.get_rank() == src
    data = _as_tensor(encode(value)) if mine else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    dist.broadcast(size, src, group=group)
    if not mine:
        data = _payload(size)
    dist.broadcast(data, src, group=group)
    return value if mine else read.decode(data.numpy().tobytes())


def all_gather(value: Any, read: msgspec.msgpack.Decoder, group: Any) -> list[Any]:
    """Every rank's `value`, in rank order, each read as `read`'s type."""
    data = _as_tensor(encode(value))
    sizes = [torch.empty(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.long), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [read.decode(g[: int(s.item())].numpy().tobytes()) for g, s in zip(gathered, sizes, strict=True)]
