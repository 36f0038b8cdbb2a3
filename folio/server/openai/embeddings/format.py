"""An embedding as the API returns it: cut to the dimensions asked for, then as JSON floats or base64."""

from __future__ import annotations

import base64

import torch
import torch.nn.functional as F


def fit_dimensions(vector: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """The first `dimensions` values normalised again to unit length (as OpenAI shortens its Matryoshka-
    trained embeddings); the vector itself when `dimensions` is None."""
    if dimensions is None:
        return vector
    return F.normalize(vector[:dimensions].float(), dim=0)


def encode_vector(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """The vector as JSON floats ("float") or its little-endian float32 bytes in base64 ("base64"), as OpenAI
    sends them."""
    values = vector.detach().float().cpu().numpy()
    if encoding_format == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return values.tolist()
