"""Phase timers: CUDA events on a GPU (read after the step's one synchronisation, so timing
adds none), the host clock on CPU; the host clock's reading of each phase is kept too
(``host_seconds``), since a phase that works on the host (prompt lookup) leaves no trace on the
GPU's clock."""

from __future__ import annotations

import contextlib
import time

import torch


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._pending: list[tuple[str, object, object]] = []
        self._host: dict[str, float] = {}
        self.host_seconds: dict[str, float] = {}  # host-clock seconds per phase, as of the last collect

    @contextlib.contextmanager
    def phase(self, name: str):
        host_start = time.perf_counter()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = current_stream(self.device)
            start.record(stream)
            yield
            end.record(stream)
        else:
            yield
            start, end = host_start, time.perf_counter()
        self._host[name] = self._host.get(name, 0.0) + time.perf_counter() - host_start
        self._pending.append((name, start, end))

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last collect; on CUDA call after a synchronisation."""
        totals: dict[str, float] = {}
        for name, start, end in self._pending:
            seconds = start.elapsed_time(end) / 1000.0 if self.cuda else end - start
            totals[name] = totals.get(name, 0.0) + seconds
        self._pending.clear()
        self.host_seconds, self._host = self._host, {}
        return totals


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's current stream. An event recorded without a stream looks it up through
    ``torch.cuda.is_available()`` (an environment lookup and a device count, tens of microseconds
    of host time per event); the device's index skips that."""
    return torch.cuda.current_stream(device if device.index is not None else torch.cuda.current_device())
