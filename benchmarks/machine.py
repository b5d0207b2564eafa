"""What a benchmark ran on, recorded in every JSON it writes (read by report.py)."""
from __future__ import annotations

import os
import platform
import subprocess

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, cwd=HERE,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> dict:
    """cpu, cpus (usable by this process), gpu (name when ``device`` is cuda,
    else None), torch, python, os, commit, and ``description``: one line for
    titles and tables, e.g. "AMD EPYC, 2 CPUs" or "NVIDIA H100 80GB HBM3 x 1"."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    gpu = gpus = None
    if device == "cuda" and torch.cuda.is_available():
        gpu, gpus = torch.cuda.get_device_name(), torch.cuda.device_count()
    cpu = cpu_model()
    desc = f"{gpu} x {gpus} (host {cpu}, {cpus} CPUs)" if gpu else f"{cpu}, {cpus} CPUs"
    return dict(description=desc, cpu=cpu, cpus=cpus, gpu=gpu, gpus=gpus, torch=torch.__version__,
                python=platform.python_version(), os=platform.platform(), commit=git_commit())
