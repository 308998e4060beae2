"""bench.affinity: the cpulist parser, the pinning and thread-count contexts (each restores what
it changed), and the GPU warm-up (nothing off CUDA)."""

import os

import pytest
import torch

from specdec.bench.affinity import (
    gpu_local_cpus,
    parse_cpulist,
    pinned,
    torch_threads,
    warm_gpu,
)


def test_parse_cpulist_ranges_and_singles():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5]


@pytest.mark.parametrize("text", ["a-b", "3-1", "1-2-x"])
def test_parse_cpulist_rejects_garbage(text):
    with pytest.raises(ValueError, match="cpulist"):
        parse_cpulist(text)


def test_pinned_moves_the_thread_and_restores_it():
    before = os.sched_getaffinity(0)
    one = min(before)
    with pinned([one]):
        assert os.sched_getaffinity(0) == {one}
    assert os.sched_getaffinity(0) == before
    with pinned(None):
        assert os.sched_getaffinity(0) == before
    with pytest.raises(ValueError, match="at least one CPU"):
        with pinned([]):
            pass


def test_gpu_local_cpus_falls_back_to_the_allowed_cpus(monkeypatch):
    from specdec.bench import affinity

    def no_gpu(index):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(affinity, "_pci_bus_id", no_gpu)
    assert gpu_local_cpus() == sorted(os.sched_getaffinity(0))


def test_gpu_local_cpus_reads_the_devices_numa_cpus(monkeypatch):
    """nvidia-smi's 8-digit PCI domain becomes sysfs's 4 digits; the result keeps only CPUs this
    process may use."""
    from specdec.bench import affinity

    allowed = sorted(os.sched_getaffinity(0))
    read = []

    class FakePath:
        def __init__(self, *parts):
            self.path = "/".join(parts)

        def read_text(self):
            read.append(self.path)
            return f"{allowed[-1]},{allowed[-1] + 1000}\n"  # one allowed CPU, one that is not

    monkeypatch.setattr(affinity, "_pci_bus_id", lambda index: "00000000:19:00.0")
    monkeypatch.setattr(affinity, "Path", FakePath)
    assert gpu_local_cpus(0) == [allowed[-1]]
    assert read == ["/sys/bus/pci/devices/0000:19:00.0/local_cpulist"]


def test_torch_threads_sets_the_count_and_restores_it():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with torch_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="thread count"), torch_threads(bad):
            pass
    assert torch.get_num_threads() == before


def test_warm_gpu_does_nothing_off_cuda(monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("warm_gpu made a tensor for a CPU device")

    monkeypatch.setattr(torch, "randn", no_work)
    warm_gpu("cpu", 10.0)
    warm_gpu("cuda", 0.0)


@pytest.mark.cuda
def test_warm_gpu_keeps_the_gpu_busy_for_the_time_asked():
    import time

    started = time.perf_counter()
    warm_gpu("cuda", 0.05)
    assert time.perf_counter() - started >= 0.05
