"""Device, default dtype and memory budget for CPU and CUDA."""

from __future__ import annotations

import os

import torch

DEFAULT_KV_SHARE = 0.25  # of available memory, for the KV pool when none is given
DEFAULT_KV_CAP = 4 << 30


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
