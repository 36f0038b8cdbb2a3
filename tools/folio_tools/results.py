"""Result files of folio's tools (benchmarks, evaluations): the machine a result was measured on, where
its files go, and writes that appear whole or not at all.

Results are written to a temporary `*.tmp` file beside the final one and renamed over it, so a killed
or failed run never leaves a half-written JSON or PNG under a result's name.
"""

from __future__ import annotations

import json
import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

from folio.paths import atomic_open


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def result_paths(output_dir: Path, kind: str, model: str, date_utc: str, *tags: str) -> tuple[Path, Path]:
    """`<output_dir>/<kind>_<model>_<tags...>_<stamp>` + `.json` and `.png`, with the directory made.
    Suffixes are appended, never substituted: model file names have dots (SmolLM2-135M-Instruct.Q4_1)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model).name.removesuffix(".gguf")).strip("_") or "model"
    stamp = date_utc.replace("-", "").replace(":", "")
    stem = "_".join([kind, name, *tags, stamp])
    return output_dir / f"{stem}.json", output_dir / f"{stem}.png"


def write_json(path: Path, data: dict[str, Any]) -> None:
    with atomic_open(path) as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """`fig.savefig(path)`, atomically; the format comes from the final name, not the temporary one."""
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format=path.suffix.lstrip(".") or "png", dpi=dpi)
