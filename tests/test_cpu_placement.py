"""Intra-op threads and CPU pinning of the shards: the rules of text_generation_common/cpu_placement.py, the
cgroup quota readers on fake cgroup trees, and the launcher passing the result to each shard."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from launcher import config as lc
from launcher.config import LaunchError, LaunchFlags
from text_generation_common.cpu_placement import (
    PlacementError,
    cgroup_cpu_quota,
    parse_cpu_list,
    shard_placements,
    usable_cpus,
)

ALLOWED = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", [0]), ("0-3", [0, 1, 2, 3]), ("4,0-1", [4, 0, 1]), (" 2-3 , 8 ", [2, 3, 8]), ("1-1", [1])],
)
def test_cpu_lists(text: str, cpus: list[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "SHARD_CPUS is empty"),
        ("a-b", "SHARD_CPUS: 'a-b' is not a CPU number or range (e.g. 0-7,16)"),
        ("3-1", "SHARD_CPUS: '3-1' is not a valid CPU range"),
        ("-1", "SHARD_CPUS: '-1' is not a CPU number or range (e.g. 0-7,16)"),
        ("0-2,2", "SHARD_CPUS lists a CPU more than once: '0-2,2'"),
    ],
)
def test_bad_cpu_lists(text: str, message: str) -> None:
    with pytest.raises(PlacementError) as info:
        parse_cpu_list(text)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "200000 100000\n"}, 2.0),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
        ({}, None),
        ({"cpu.max": "garbage"}, None),
    ],
)
def test_cgroup_quota(tmp_path: Path, files: dict[str, str], quota: float | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(tmp_path) == quota


@pytest.mark.parametrize(
    ("affinity", "quota", "usable"), [(64, 4.0, 4), (2, None, 2), (8, 1.5, 2), (2, 0.5, 1), (4, 16.0, 4)]
)
def test_usable_cpus_follow_the_quota(affinity: int, quota: float | None, usable: int) -> None:
    assert usable_cpus(affinity, quota) == usable


def test_threads_default_to_the_usable_cpus_split_over_the_shards() -> None:
    (one,) = shard_placements(1, None, None, None, affinity=64, quota=4.0)
    assert (one.threads, one.cpus) == (4, None)
    assert one.reason == "4 usable CPUs (64 in the affinity, CPU quota 4) / 1 shards"
    assert [p.threads for p in shard_placements(3, None, None, None, affinity=8, quota=None)] == [2, 2, 2]
    assert [p.threads for p in shard_placements(4, None, None, None, affinity=2, quota=None)] == [1] * 4


def test_explicit_threads_win_over_omp_num_threads_and_cpus() -> None:
    (p,) = shard_placements(1, 3, str(ALLOWED[0]), "7", affinity=64, quota=None)
    assert (p.threads, p.cpus, p.reason) == (3, frozenset(ALLOWED[:1]), "SHARD_THREADS")
    (p,) = shard_placements(1, None, None, "7", affinity=64, quota=None)
    assert (p.threads, p.reason) == (7, "OMP_NUM_THREADS")
    with pytest.raises(PlacementError, match="OMP_NUM_THREADS must be a number, got 'x'"):
        shard_placements(1, None, None, "x")


def test_shard_cpus_split_in_order_one_slice_per_rank() -> None:
    if len(ALLOWED) < 2:
        pytest.skip("needs 2 CPUs")
    two = f"{ALLOWED[1]},{ALLOWED[0]}"
    first, second = shard_placements(2, None, two, None)
    assert (first.cpus, second.cpus) == (frozenset([ALLOWED[1]]), frozenset([ALLOWED[0]]))
    assert first.threads == second.threads == 1 and first.reason == "its 1 SHARD_CPUS"
    (both,) = shard_placements(1, None, two, None)
    assert both.cpus == frozenset(ALLOWED[:2]) and both.threads == 2


def test_shard_cpus_that_cannot_be_used_are_refused() -> None:
    with pytest.raises(PlacementError, match="do not split evenly over 2 shards"):
        shard_placements(2, None, str(ALLOWED[0]), None)
    with pytest.raises(
        PlacementError, match=r"SHARD_CPUS names CPUs this process may not run on: \[100000\]"
    ):
        shard_placements(1, None, "100000", None)


def test_the_launcher_gives_each_shard_its_threads_and_cpus(tiny_model: Callable[..., Path]) -> None:
    model = str(tiny_model("llama"))
    config = lc.resolve_config(
        LaunchFlags(model_name=model, shard_cpus=str(ALLOWED[0])), {"OMP_NUM_THREADS": "5"}
    )
    env = lc.shard_env(config, 0, {"OMP_NUM_THREADS": "5"})
    assert env["OMP_NUM_THREADS"] == "5" and env["CPU_AFFINITY"] == str(ALLOWED[0])
    config = lc.resolve_config(LaunchFlags(model_name=model, shard_threads=1), {})
    env = lc.shard_env(config, 0, {})
    assert env["OMP_NUM_THREADS"] == "1" and "CPU_AFFINITY" not in env
    with pytest.raises(LaunchError, match="SHARD_CPUS: 'x' is not a CPU number"):
        lc.resolve_config(LaunchFlags(model_name=model, shard_cpus="x"), {})
