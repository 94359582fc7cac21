"""`--cpu-affinity` core assignment and the store flags of `deepinfer serve`."""
from __future__ import annotations

import argparse
import os

import pytest

from deepinfer.cluster.cluster_args import _store_url_with_capacity, add_cluster_args
from deepinfer.cluster.cpu_affinity import assign_cpus, pin_to_cpus


def test_assign_cpus_gives_disjoint_groups_then_shares():
    assert assign_cpus(2, [0, 1]) == [(0,), (1,)]
    assert assign_cpus(3, [3, 0, 1, 2, 4]) == [(0, 1), (2, 3), (4,)]
    assert assign_cpus(4, [0, 1]) == [(0,), (1,), (0,), (1,)]  # more workers than cores
    with pytest.raises(ValueError):
        assign_cpus(0, [0])
    with pytest.raises(ValueError):
        assign_cpus(1, [])


def test_pin_to_cpus_in_a_child_process():
    cpus = sorted(os.sched_getaffinity(0))
    pid = os.fork()
    if pid == 0:  # the child pins itself and reports through its exit code
        pin_to_cpus((cpus[-1],))
        os._exit(0 if os.sched_getaffinity(0) == {cpus[-1]} else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sorted(os.sched_getaffinity(0)) == cpus  # the parent is untouched


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    return parser.parse_args(argv)


def test_store_flags_fold_into_the_url():
    args = parse("--kv-store", "fs:///tmp/x", "--kv-store-capacity", "1MiB",
                 "--kv-host-cache", "2MiB", "--cpu-affinity")
    assert args.cpu_affinity
    assert _store_url_with_capacity(args) == \
        "fs:///tmp/x?capacity_bytes=1048576&host_cache_bytes=2097152"
    assert _store_url_with_capacity(parse("--kv-store", "redis://h:1/0", "--kv-host-cache",
                                          "1KiB")) == "redis://h:1/0?host_cache_bytes=1024"
    with pytest.raises(ValueError, match="needs a shared store"):
        _store_url_with_capacity(parse("--kv-store", "none", "--kv-host-cache", "1KiB"))
