"""bench.affinity: the cpulist parser and the pinning context (restores what it changed)."""

import os

import pytest

from specdec.bench.affinity import gpu_local_cpus, parse_cpulist, pinned


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


def test_gpu_local_cpus_falls_back_to_the_allowed_cpus():
    allowed = os.sched_getaffinity(0)
    cpus = gpu_local_cpus()
    assert cpus and set(cpus) <= allowed  # no GPU here: every allowed CPU
