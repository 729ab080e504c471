"""The hardware a box runs on: the device it uses, that device in words, and its hardware slug.

The slug (`cpu-<cores>c`, or `nvidia-` and the GPU's name words) is what a tuned profile is filed
under (appliance/profiles.py): two machines with the same slug take the same profile. torch is
imported only to ask about a GPU, so a CPU or gateway box never pays for it here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Words in a GPU's marketing name that say memory, form factor or generation, not which chip it is:
# "NVIDIA H100 80GB HBM3" and "NVIDIA H100 PCIe" are both nvidia-h100.
_GPU_NAME_STOP = re.compile(r"^(\d+gb|sxm\d*|pcie|hbm\d*e?|nvl|mig|server|workstation|edition|blackwell|max-q)$")
_GPU_NAME_DROP = frozenset({"nvidia", "geforce", "tesla", "quadro"})


def resolve_device(setting: str) -> str:
    """The device a box computes on: the setting itself, or for `auto` the GPU when there is one."""
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(device: str) -> str:
    """The device in a few words, for the heartbeat: the GPU's name, or `cpu (<cores> cores)`."""
    return _gpu_name(device) if device.startswith("cuda") else f"cpu ({cpu_cores()} cores)"


def _gpu_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def cpu_cores() -> int:
    """The cores this process may run on (a container's cpuset, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def gpu_slug(name: str) -> str:
    """`NVIDIA H200` -> `nvidia-h200`; `NVIDIA RTX PRO 6000 Blackwell Server Edition` -> `nvidia-rtx-pro-6000`."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    kept: list[str] = []
    for word in words:
        if _GPU_NAME_STOP.match(word):
            break
        if word not in _GPU_NAME_DROP:
            kept.append(word)
    return "-".join(["nvidia", *kept]) if kept else "nvidia-gpu"


# The forms `hardware_slug` gives: `cpu-<cores>c`, or `nvidia-` and the GPU's name words.
HARDWARE_SLUG = re.compile(r"cpu-[1-9][0-9]*c|nvidia(-[a-z0-9]+)+")


def hardware_slug(device: str) -> str:
    """The slug of the hardware a device runs on: `cpu-<cores>c`, or the GPU's `nvidia-...`."""
    return gpu_slug(_gpu_name(device)) if device.startswith("cuda") else f"cpu-{cpu_cores()}c"


def device_description(device: str) -> str:
    """The device in words, for reports: the GPU's name, or the CPU model and its cores."""
    if device.startswith("cuda"):
        return _gpu_name(device)
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or 'CPU'} ({cpu_cores()} cores)"
