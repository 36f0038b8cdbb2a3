"""Device, default dtype and memory budget for CPU and CUDA."""

from __future__ import annotations

import ctypes
import os

import torch

DEFAULT_KV_SHARE = 0.25  # of available memory, for the KV pool when none is given
DEFAULT_KV_CAP = 4 << 30
OMP_PAUSE_HARD = 2  # OpenMP's omp_pause_resource_t: omp_pause_hard frees the threads


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


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


def configure_threads() -> None:
    """Use every core for intra-op parallelism unless the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(os.cpu_count() or 1)


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
