"""Device, default dtype and memory budget for CPU and CUDA."""

from __future__ import annotations

import ctypes
import os

import torch

from folio.config import parse_dtype

DEFAULT_KV_SHARE = 0.25  # of available memory, for the KV pool when none is given
DEFAULT_KV_CAP = 4 << 30
OMP_PAUSE_HARD = 2  # OpenMP's omp_pause_resource_t: omp_pause_hard frees the threads


# CPU flags of native bfloat16 arithmetic: AVX-512 BF16 (Zen 4, Cooper Lake on), AMX (Sapphire Rapids on),
# Arm's BF16 extension (v8.6).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (x86 `flags`, Arm `Features`); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def native_bfloat16(device: torch.device) -> str | None:
    """What multiplies bfloat16 natively on `device` (a CPU's flags, or "the GPU"), or None."""
    if device.type == "cuda":
        return "the GPU" if torch.cuda.is_bf16_supported() else None
    native = sorted(cpu_flags() & NATIVE_BF16_FLAGS)
    return ", ".join(native) if native else None


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> tuple[torch.dtype, str]:
    """The activation dtype for `--dtype` and why, for the start-up line.

    float32 is the default: with it every matmul of kept quantized weights runs through the integer dot
    products at any batch, so a request's greedy tokens do not depend on what else is in its batch, and
    speculation and parallelism keep them bit for bit. `auto` takes bfloat16 where the hardware
    multiplies it natively: on this project's CPU (Zen 4) it prefills 1.2-1.45x and batches 1.1x faster,
    decodes at batch 1 within -5%..+13%, and scores the same held-out perplexity (+0.01% smollm2, -0.05%
    gemma3), but it changes 20 of 32 greedy continuations within 32 tokens and, past 64 rows, widens
    weights into bfloat16 GEMMs whose rounding follows the batch (docs/benchmarks.md). Without native
    bfloat16 it is emulated and slower, so `auto` takes float32 there."""
    native = native_bfloat16(device)
    if isinstance(name, str) and name.lower() == "auto":
        if native:
            return torch.bfloat16, f"auto: {native} multiplies bfloat16 natively"
        return torch.float32, "auto: no native bfloat16 arithmetic here"
    dtype = parse_dtype(name)
    if dtype == torch.float32 and native:
        return dtype, f"the default; --dtype auto takes bfloat16, native here ({native})"
    return dtype, "as asked"


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30  # no /proc (macOS): assume a modest machine


def default_kv_cache_memory(device: torch.device) -> int:
    return min(int(available_memory(device) * DEFAULT_KV_SHARE), DEFAULT_KV_CAP)


def default_threads() -> int:
    """Intra-op threads: OMP_NUM_THREADS where the user set it, else every core."""
    chosen = os.environ.get("OMP_NUM_THREADS", "")
    return int(chosen) if chosen.isdigit() and int(chosen) > 0 else os.cpu_count() or 1


def configure_threads() -> None:
    torch.set_num_threads(default_threads())


def release_openmp_workers() -> bool:
    """Stop the OpenMP worker threads of the calling thread (libgomp's `omp_pause_resource_all`); False
    where there is no libgomp to ask (another OpenMP runtime, or none).

    libgomp gives every thread that runs a parallel region its own team of workers, and once it manages
    more threads than there are cores it stops spinning at barriers (about 1,000 iterations, then a
    futex sleep). Loading a model on one thread and stepping the engine on another doubled the threads,
    and a decode step's hundreds of barriers then cost it 2.2x (smollm2 batch-1 on 2 cores: 92 against
    210 tok/s). The thread that loaded the model calls this when it hands the model to the engine
    thread; a parallel region it runs later starts a team again."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # the one torch loaded, if it uses libgomp
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_HARD) == 0
