"""The machine a benchmark ran on (GPU, driver, CPU, versions), and the results folder named after it."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from packgraph import slot_boundary

__all__ = ["default_out_dir", "machine_info"]


def _run(cmd: Sequence[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict[str, Any]:
    """GPU name and driver (when readable), CPU, date and the torch / triton / CUDA / Python versions."""
    info: dict[str, Any] = {
        "device": str(device),
        "gpu": None,
        "driver": None,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "short_docs_min_slots": slot_boundary.DEFAULT_MIN_SLOTS,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        if smi:
            info["driver"] = smi.splitlines()[0].strip()
        else:
            try:
                text = Path("/proc/driver/nvidia/version").read_text()
                match = re.search(r"Kernel Module\s+(\S+)", text)
                info["driver"] = match.group(1) if match else None
            except OSError:
                pass
    return info


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def default_out_dir(device: torch.device, dry_run: bool) -> Path:
    """``bench/results/<YYYY-MM-DD>-<gpu-slug>/`` (``cpu``, and ``-dry-run`` for dry runs)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    suffix = "-dry-run" if dry_run else ""
    return Path("bench") / "results" / f"{dt.date.today().isoformat()}-{_slug(name)}{suffix}"
