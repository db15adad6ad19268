"""Slow a process down for real: a cgroup (v1 ``cpu`` controller) with a CFS quota.

``CpuQuota("name")`` makes ``/sys/fs/cgroup/cpu/<name>-<pid>``; ``add(pid)`` moves a process
(all its threads) in; ``limit(cores)`` lets it use that many cores' worth of CPU time per
period (0.25: a quarter of one core); ``close()`` moves the processes still there back
to the root group and removes the group, by its name only. Used by the speed-planning tests
and benchmarks to make one member's rpc-server several times slower than the others.
``quota_rpc_build`` makes a --llama-bin directory whose rpc-server enters a group as it starts,
so a node's own calibration already sees it slowed.
"""

from __future__ import annotations

import os
from pathlib import Path

from mesh_sidecar.llama.build import LlamaBinaries
from tests.helpers.llama import wrapped_rpc_build

CPU_CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
MIN_QUOTA_US = 1000  # the smallest cpu.cfs_quota_us (and cfs_period_us) the kernel accepts


def cgroup_cpu_available() -> bool:
    """Whether this machine lets us make cpu cgroups (v1, writable)."""
    return (CPU_CGROUP_ROOT / "cgroup.procs").exists() and os.access(CPU_CGROUP_ROOT, os.W_OK)


class CpuQuota:
    """One cpu cgroup of our own, removed on ``close()`` (or leaving a ``with`` block)."""

    def __init__(self, name: str) -> None:
        self.path = CPU_CGROUP_ROOT / f"{name}-{os.getpid()}"
        self.path.mkdir()

    def add(self, pid: int) -> None:
        """Move process ``pid`` and every thread of it into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def limit(self, cores: float | None, *, period_us: int | None = None) -> None:
        """At most ``cores`` cores' worth of CPU time per period (None: no limit); by default the shortest
        period the kernel takes for that share (4 ms for 0.25).

        A quota caps a share of each period, not the pace: a process busy for less than its quota in a
        period runs at full speed. With a 100 ms period a stage of a few ms a token is hardly slowed until
        it is busy more than ``cores`` of the time; the shortest period makes a device slow throughout."""
        (self.path / "cpu.cfs_quota_us").write_text("-1")  # a period below the quota in force is refused
        if cores is None:
            return
        period_us = period_us or self.shortest_period_us(cores)
        (self.path / "cpu.cfs_period_us").write_text(str(period_us))
        (self.path / "cpu.cfs_quota_us").write_text(str(max(MIN_QUOTA_US, round(cores * period_us))))

    @staticmethod
    def shortest_period_us(cores: float) -> int:
        """The shortest period the kernel takes for a share of ``cores`` (its quota at the 1 ms floor)."""
        return max(MIN_QUOTA_US, round(MIN_QUOTA_US / cores))

    def pids(self) -> list[int]:
        return [int(line) for line in (self.path / "cgroup.procs").read_text().split()]

    def close(self) -> None:
        if not self.path.exists():
            return
        for pid in self.pids():
            try:
                (CPU_CGROUP_ROOT / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # it exited meanwhile
        self.path.rmdir()

    def __enter__(self) -> CpuQuota:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def quota_rpc_build(binaries: LlamaBinaries, directory: Path, group: CpuQuota) -> Path:
    """A --llama-bin ``directory``: the real llama-server, and an rpc-server that joins ``group`` and runs."""
    return wrapped_rpc_build(binaries, directory,
                             f'echo $$ > "{group.path}/cgroup.procs"\nexec "{binaries.rpc_server}" "$@"')
