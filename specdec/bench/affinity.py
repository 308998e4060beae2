"""Timing conditions of the benchmark's passes: where the host thread runs, how many intra-op
threads torch keeps, and whether the GPU's clocks are up when a pass starts.

At the zoo's sizes a decoding step is host-bound (the GPU runs a graphed step of the target in
a fraction of the step's time), so a pass's time follows the speed of the core the Python thread
runs on, and passes of the same work can run at different speeds. Remedies: the main thread
pinned to one core on the GPU's own NUMA node (``pinned``, opt-in), and two that narrow the
spread: one torch thread (``torch_threads(1)``: no idle intra-op workers spinning beside the main
thread) and GPU work right before each pass (``warm_gpu``: the GPU clocks down while the host
prepares the next pass), which the policy bench applies by default.

Invariant: these change where and when work runs, never what it computes; each context manager
restores what it changed on exit. Cost: the warm-up's milliseconds of GPU work before each pass.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import torch


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"not a cpulist: {text!r} (expected e.g. '0-3,8')") from None
        if last < first:
            raise ValueError(f"not a cpulist: {text!r} (range {part!r} runs backwards)")
        cpus.extend(range(first, last + 1))
    return cpus


def _pci_bus_id(device_index: int) -> str:
    """The PCI bus id of CUDA device ``device_index`` (torch's numbering, after
    CUDA_VISIBLE_DEVICES) when torch reports it, else nvidia-smi's for that index."""
    import torch

    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(device_index)
        if all(hasattr(properties, f"pci_{part}_id") for part in ("domain", "bus", "device")):
            return f"{properties.pci_domain_id:08x}:{properties.pci_bus_id:02x}:{properties.pci_device_id:02x}.0"
    return subprocess.run(
        ["nvidia-smi", f"--id={device_index}", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30, check=True).stdout.strip()


def gpu_local_cpus(device_index: int = 0) -> list[int]:
    """The CPUs this process may use that sit on the NUMA node of CUDA device ``device_index``
    (from the PCI device's ``local_cpulist``); every allowed CPU when that cannot be read (no
    GPU, no nvidia-smi, no sysfs)."""
    allowed = sorted(os.sched_getaffinity(0))
    try:
        bus_id = _pci_bus_id(device_index)
        # nvidia-smi prints an 8-digit domain (00000000:19:00.0); sysfs uses 4 (0000:19:00.0)
        domain, _, rest = bus_id.partition(":")
        local = parse_cpulist(Path(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}".lower(), "local_cpulist").read_text())
    except (OSError, subprocess.SubprocessError, ValueError, RuntimeError, AssertionError):
        return allowed
    return [c for c in allowed if c in set(local)] or allowed


@contextlib.contextmanager
def pinned(cpus: list[int] | None):
    """Run the calling thread on ``cpus`` inside the block (None: leave it where it is). Only
    the calling thread is restored on exit: threads started inside the block keep ``cpus``."""
    if cpus is None:
        yield
        return
    if not cpus:
        raise ValueError("pinned() needs at least one CPU, got an empty list")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def torch_threads(count: int | None):
    """torch's intra-op thread count set to ``count`` inside the block (None: left as it is)."""
    if count is None:
        yield
        return
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"torch_threads needs a thread count >= 1 or None, got {count!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def warm_gpu(device: torch.device | str, seconds: float) -> None:
    """Keep a CUDA device busy with matrix products for about ``seconds`` and wait for them, so
    its clocks are up when the timed work that follows starts; nothing on other devices or for
    ``seconds`` <= 0."""
    device = torch.device(device)
    if device.type != "cuda" or seconds <= 0:
        return
    x = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)  # [2048, 2048]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize(device)
