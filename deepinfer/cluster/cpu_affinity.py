"""`--cpu-affinity`: pin each worker process to its own cores, so workers do not compete for
compute (fair benchmarks: every worker gets dedicated cores, as on separate machines)."""
from __future__ import annotations

import os


def assign_cpus(num_workers: int, cpus: list[int]) -> list[tuple[int, ...]]:
    """Cores per worker, in worker order: disjoint contiguous groups of len(cpus) // W (the
    first len(cpus) % W workers get one more); with more workers than cores, cores are shared
    round-robin (one each)."""
    if num_workers < 1 or not cpus:
        raise ValueError("need at least one worker and one cpu")
    cpus = sorted(cpus)
    if num_workers > len(cpus):
        return [(cpus[i % len(cpus)],) for i in range(num_workers)]
    base, extra = divmod(len(cpus), num_workers)
    groups, start = [], 0
    for i in range(num_workers):
        size = base + (1 if i < extra else 0)
        groups.append(tuple(cpus[start:start + size]))
        start += size
    return groups


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pin_to_cpus(cpu_ids: tuple[int, ...]) -> None:
    """Pin the calling process (before the engine starts its threads)."""
    os.sched_setaffinity(0, cpu_ids)
