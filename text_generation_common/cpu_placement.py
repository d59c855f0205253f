"""How many intra-op threads each shard runs and, optionally, which CPUs it is pinned to.

torch sizes its OpenMP pool by the CPUs the process may run on, not by a container's CPU quota:
a pod limited to 4 CPUs on a 64-core node would start 64 threads per shard, which then fight
over 4 CPUs' worth of time. The launcher therefore gives every shard OMP_NUM_THREADS:

    --shard-threads / SHARD_THREADS      if given,
    else OMP_NUM_THREADS                 if the launcher's environment sets it,
    else the CPUs this shard may use     (its --shard-cpus slice, else the usable CPUs / NUM_SHARD),

where the usable CPUs are the launcher's affinity, capped by the cgroup CPU quota (v2 cpu.max,
v1 cpu.cfs_quota_us), rounded up. --shard-cpus / SHARD_CPUS (a list such as "0-7,16-23") pins
the shards: it is split in order into NUM_SHARD equal slices, one per rank, which the launcher
hands to each shard as CPU_AFFINITY (`serve --cpu-affinity`: the shard pins itself before it
loads anything, so every thread it starts inherits the set). The router stays unpinned.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


class PlacementError(ValueError):
    """A CPU list or thread count that cannot be used."""


@dataclass(frozen=True, slots=True)
class ShardPlacement:
    threads: int  # OMP_NUM_THREADS of the shard
    cpus: frozenset[int] | None  # pinned to these CPUs; None = not pinned
    reason: str  # where `threads` comes from, for the launcher's log line


def parse_cpu_list(text: str, name: str = "SHARD_CPUS") -> list[int]:
    """ "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11] (order kept, duplicates refused); `name` is
    the setting the errors name."""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, dash, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            raise PlacementError(f"{name}: {part!r} is not a CPU number or range (e.g. 0-7,16)") from None
        if lo < 0 or hi < lo:
            raise PlacementError(f"{name}: {part!r} is not a valid CPU range")
        cpus.extend(range(lo, hi + 1))
    if not cpus:
        raise PlacementError(f"{name} is empty")
    if len(set(cpus)) != len(cpus):
        raise PlacementError(f"{name} lists a CPU more than once: {text!r}")
    return cpus


def check_allowed(cpus: list[int], name: str) -> None:
    missing = sorted(set(cpus) - os.sched_getaffinity(0))
    if missing:
        raise PlacementError(f"{name} names CPUs this process may not run on: {missing}")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2, else v1); None when unlimited or unknown."""
    try:
        fields = (root / "cpu.max").read_text().split()  # "max 100000" or "200000 100000"
    except OSError:
        try:
            fields = [
                (root / "cpu" / "cpu.cfs_quota_us").read_text().strip(),  # -1 = unlimited
                (root / "cpu" / "cpu.cfs_period_us").read_text().strip(),
            ]
        except OSError:
            return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except (ValueError, IndexError):
        return None  # "max" or unreadable
    return quota / period if quota > 0 and period > 0 else None


def usable_cpus(affinity: int, quota: float | None) -> int:
    """The CPUs the launcher can keep busy: its affinity, capped by the quota (rounded up)."""
    if quota is None:
        return affinity
    return max(1, min(affinity, math.ceil(quota)))


def shard_placements(
    num_shard: int,
    threads: int | None,
    cpu_list: str | None,
    inherited_omp: str | None,
    affinity: int | None = None,
    quota: float | None = None,
) -> list[ShardPlacement]:
    """One placement per rank (see the module docstring for the rules). `affinity` and `quota`
    default to this process's (os.sched_getaffinity, cgroup_cpu_quota)."""
    if threads is not None and threads < 1:
        raise PlacementError(f"SHARD_THREADS must be >= 1, got {threads}")
    slices: list[frozenset[int] | None] = [None] * num_shard
    if cpu_list:
        cpus = parse_cpu_list(cpu_list)
        if len(cpus) % num_shard:
            raise PlacementError(
                f"SHARD_CPUS has {len(cpus)} CPUs, which do not split evenly over {num_shard} shards"
            )
        check_allowed(cpus, "SHARD_CPUS")
        size = len(cpus) // num_shard
        slices = [frozenset(cpus[r * size : (r + 1) * size]) for r in range(num_shard)]
    placements = []
    for own in slices:
        if threads is not None:
            count, reason = threads, "SHARD_THREADS"
        elif inherited_omp:
            try:
                count, reason = int(inherited_omp), "OMP_NUM_THREADS"
            except ValueError:
                raise PlacementError(f"OMP_NUM_THREADS must be a number, got {inherited_omp!r}") from None
        elif own is not None:
            count, reason = len(own), f"its {len(own)} SHARD_CPUS"
        else:
            if affinity is None:
                affinity = len(os.sched_getaffinity(0))
                quota = cgroup_cpu_quota()
            usable = usable_cpus(affinity, quota)
            count = max(1, usable // num_shard)
            limit = f"CPU quota {quota:g}" if quota is not None else "no CPU quota"
            reason = f"{usable} usable CPUs ({affinity} in the affinity, {limit}) / {num_shard} shards"
        placements.append(ShardPlacement(count, own, reason))
    return placements
