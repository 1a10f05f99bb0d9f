"""How many CPU cores this process can really use now, and the torch thread count ``threads=auto`` picks from them.

On a machine that other work keeps busy, torch's threads wait for each other: a training step with two threads on a
2-core machine whose other core runs someone else's job took 19× as long as with one thread (issue 61). So
``threads=auto`` counts the cores this process may have *and* leaves out those other processes use now:

1. **the cores this process may run on**: :func:`os.sched_getaffinity` (else :func:`os.cpu_count`), capped by a
   cgroup CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``: a container's
   ``--cpus=1.5`` is 1 core) — :func:`available_cores`;
2. **minus the cores other work keeps busy now**: ``/proc/stat`` sampled twice, :data:`WINDOW_S` apart, on this
   process's CPUs only, less the CPU time of this process itself (``/proc/self/stat``) and, for a job that a
   parallel launcher started beside others, of the launch's own processes (its parent and the parent's other
   children: the sweep's jobs are shared out below, not other work) — :func:`busy_cores`. The free cores are
   rounded to the nearest whole core, so that a mostly idle machine (less than half a core busy) keeps all its
   cores, and are never fewer than 1;
3. **shared among the jobs run at once**: divided by joblib's ``n_jobs`` (``-1``: every core); a submitit job
   takes its ``cpus_per_task`` (what SLURM gives it), unmeasured.

``$OMP_NUM_THREADS`` (a positive integer) and an explicit integer ``threads=`` win over all of it
(:func:`choose_threads`). Where nothing can be measured (no ``/proc``: macOS), the busy cores are unknown and
counted as none. The rule is one function for the run (:func:`attnlab.training.config.set_threads`) and its plan
(``--dry-run``, :mod:`attnlab.training.plan`), which also prints the measurement.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BUSY_FRACTION",
    "WINDOW_S",
    "Machine",
    "Snapshot",
    "ThreadChoice",
    "affinity",
    "auto_threads",
    "available_cores",
    "busy_between",
    "busy_cores",
    "cgroup_quota",
    "choose_threads",
    "launch_pids",
    "measure",
    "snapshot",
]

WINDOW_S = 0.2
"""Seconds between the two samples of ``/proc/stat`` (20 clock ticks: the busy cores to about 0.05 each)."""
BUSY_FRACTION = 0.5
"""A machine whose other work keeps more than this fraction of this process's cores busy is *busy*: a plan says so
(:attr:`Machine.is_busy`), since the load alone makes its estimate long."""

PROC = Path("/proc")
"""Where ``stat``, ``self/stat``, ``self/cgroup`` and ``<pid>/stat`` are read (tests point it at a fake tree)."""
CGROUP = Path("/sys/fs/cgroup")
"""Where the cgroup file systems are mounted (v2: ``cpu.max``; v1: ``cpu/cpu.cfs_quota_us`` ...)."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


# ------------------------------------------------------------------------------------------ cores this process has


def affinity() -> list[int]:
    """The CPUs (their numbers) this process may run on: :func:`os.sched_getaffinity`, else ``0 .. cpu_count-1``."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (macOS has no affinity)
        return list(range(os.cpu_count() or 1))


def _cgroup_paths() -> dict[str, str]:
    """This process's cgroup per controller (``/proc/self/cgroup``): ``{"": path}`` for v2, ``{"cpu": path}`` ..."""
    out: dict[str, str] = {}
    for line in (_read(PROC / "self" / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2].strip()
    return out


def _ancestors(root: Path, path: str) -> list[Path]:
    """``root/path`` and each folder above it up to ``root`` (a quota anywhere above caps this process too); just
    ``root`` where the path is not there (a container sees its own cgroup at the mount's root)."""
    folders = [root]
    parts = [p for p in path.split("/") if p and p != ".."]
    for i in range(1, len(parts) + 1):
        folders.append(root.joinpath(*parts[:i]))
    return [f for f in folders if f.is_dir()]


def _quota_v2(folder: Path) -> float | None:
    text = _read(folder / "cpu.max")
    if not text:
        return None
    fields = text.split()
    if len(fields) < 1 or fields[0] == "max":
        return None
    try:
        quota, period = float(fields[0]), float(fields[1]) if len(fields) > 1 else 100_000.0
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(folder: Path) -> float | None:
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    try:
        q, p = float((quota or "").strip()), float((period or "").strip())
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_quota() -> float | None:
    """The cores this process's cgroup CPU quota allows (``1.5`` for a container's ``--cpus=1.5``), the smallest of
    those set on its cgroup and the ones above it; None when no quota is set or none can be read. cgroup v2:
    ``cpu.max`` (``"<quota> <period>"`` or ``"max ..."``); v1: ``cpu.cfs_quota_us`` (``-1``: none) over
    ``cpu.cfs_period_us``."""
    paths = _cgroup_paths()
    found: list[float] = []
    if "" in paths or (CGROUP / "cpu.max").exists():
        for folder in _ancestors(CGROUP, paths.get("", "/")):
            quota = _quota_v2(folder)
            if quota is not None:
                found.append(quota)
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        root = CGROUP / mount
        if root.is_dir():
            for folder in _ancestors(root, paths.get("cpu", "/")):
                quota = _quota_v1(folder)
                if quota is not None:
                    found.append(quota)
    return min(found) if found else None


def available_cores() -> int:
    """The cores this process may use: its CPUs (:func:`affinity`), capped by the cgroup quota
    (:func:`cgroup_quota`, rounded down: threads beyond the quota are throttled), never fewer than 1."""
    cores = len(affinity()) or (os.cpu_count() or 1)
    quota = cgroup_quota()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


# ------------------------------------------------------------------------------------------ cores busy with other work


@dataclass(frozen=True)
class Snapshot:
    """One sample: each CPU's (busy, all) clock ticks since boot (``/proc/stat``'s ``cpuN`` lines), and the CPU
    ticks so far of the processes whose work is not *other* work (this process; a launch's own)."""

    cpus: dict[int, tuple[int, int]]
    own: dict[int, int]


def _cpu_ticks(text: str) -> dict[int, tuple[int, int]]:
    """``/proc/stat``'s per-CPU lines → ``{cpu: (busy ticks, all ticks)}``: busy is user, nice, system, irq,
    softirq and steal (a hypervisor's steal is a core this process does not get); idle and iowait are not."""
    out: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit():
            continue
        try:
            ticks = [int(v) for v in rest.split()[:8]]
        except ValueError:
            continue
        ticks += [0] * (8 - len(ticks))
        user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
        out[int(name[3:])] = (user + nice + system + irq + softirq + steal, sum(ticks))
    return out


def _process_stat(pid: int | str) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the command's name (which may hold spaces and parentheses): index 0 is
    the state, 1 the parent's pid, 11 and 12 the user and system ticks."""
    text = _read(PROC / str(pid) / "stat")
    if not text or ")" not in text:
        return None
    fields = text.rpartition(")")[2].split()
    return fields if len(fields) >= 13 else None


def _ticks_of(pids: Iterable[int]) -> dict[int, int]:
    out = {}
    for pid in pids:
        fields = _process_stat(pid)
        if fields is not None:
            try:
                out[pid] = int(fields[11]) + int(fields[12])
            except ValueError:
                continue
    return out


def launch_pids(root: int | None = None) -> set[int]:
    """The processes of this process's launch: ``root`` (default: the parent) and every process below it. For a
    job that a parallel launcher (joblib's workers) started beside others: their work is the sweep's, shared out by
    dividing the cores, not other work."""
    root = os.getppid() if root is None else root
    children: dict[int, list[int]] = {}
    try:
        entries = [p.name for p in PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return {root, os.getpid()}
    for name in entries:
        fields = _process_stat(name)
        if fields is not None and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found | {os.getpid()}


def snapshot(own: Callable[[], Iterable[int]] | None = None) -> Snapshot | None:
    """A sample of ``/proc/stat`` and of the CPU ticks of the processes ``own()`` names (default: this one); None
    where ``/proc/stat`` cannot be read."""
    text = _read(PROC / "stat")
    if text is None:
        return None
    cpus = _cpu_ticks(text)
    if not cpus:
        return None
    return Snapshot(cpus, _ticks_of(own() if own is not None else [os.getpid()]))


def busy_between(before: Snapshot, after: Snapshot, cpus: Iterable[int] | None = None) -> float:
    """The cores busy with other work between two samples: on each of ``cpus`` (default: every CPU of the samples)
    its busy share of the interval, summed, less the cores the own processes kept busy (their ticks over the
    interval's ticks per CPU); from 0 to the number of CPUs."""
    wanted = list(after.cpus) if cpus is None else [c for c in cpus if c in after.cpus and c in before.cpus]
    busy, elapsed = 0.0, []
    for cpu in wanted:
        db = after.cpus[cpu][0] - before.cpus[cpu][0]
        dt = after.cpus[cpu][1] - before.cpus[cpu][1]
        if dt > 0:
            busy += min(1.0, max(0.0, db / dt))
            elapsed.append(dt)
    if not elapsed:
        return 0.0
    per_cpu = sum(elapsed) / len(elapsed)
    own = sum(max(0, t - before.own.get(pid, 0)) for pid, t in after.own.items())
    return min(float(len(elapsed)), max(0.0, busy - own / per_cpu))


def busy_cores(
    window_s: float = WINDOW_S, launched: bool = False, sleep: Callable[[float], Any] = time.sleep
) -> float | None:
    """The cores of this process's CPUs that other processes keep busy now: ``/proc/stat`` sampled ``window_s``
    apart (:func:`busy_between`), this process's own CPU time left out, and with ``launched`` (a job that a
    parallel launcher started beside others) its launch's too (:func:`launch_pids`). None where it cannot be
    measured (no ``/proc/stat``)."""
    own = launch_pids if launched else None
    before = snapshot(own)
    if before is None:
        return None
    sleep(max(0.0, window_s))
    after = snapshot(own)
    if after is None:
        return None
    return busy_between(before, after, affinity())


# ------------------------------------------------------------------------------------------ the choice


@dataclass(frozen=True)
class Machine:
    """This machine as a run would find it now."""

    cores: int
    """The cores this process may use (:func:`available_cores`)."""
    busy: float | None
    """Of this process's CPUs, the cores other work keeps busy now (:func:`busy_cores`); None: not measured."""
    load: float | None = None
    """The one-minute load average (runnable processes), for the record; None where there is none."""
    cpus: int | None = None
    """This process's CPUs (:func:`affinity`): more than :attr:`cores` under a cgroup quota."""

    @property
    def free(self) -> int:
        """The whole cores left to this process: :attr:`cores`, less the busy ones (of its CPUs), rounded to the
        nearest (less than half a core busy keeps them all), at least 1."""
        if not self.busy:
            return self.cores
        cpus = self.cpus if self.cpus is not None else self.cores
        return max(1, min(self.cores, math.floor(cpus - self.busy + 0.5)))

    @property
    def taken(self) -> float:
        """Of :attr:`cores`, how much other work takes now: the busy CPUs beyond those this process's quota leaves
        spare (under a quota of 4 cores on 64 CPUs, 10 busy CPUs take none of its 4), 0 where not measured."""
        if not self.busy:
            return 0.0
        cpus = self.cpus if self.cpus is not None else self.cores
        return max(0.0, self.cores - max(0.0, cpus - self.busy))

    @property
    def is_busy(self) -> bool:
        """Whether other work takes more than :data:`BUSY_FRACTION` of this process's cores (:attr:`taken`)."""
        return self.busy is not None and self.taken > BUSY_FRACTION * self.cores

    def describe(self) -> str:
        """``2 cores for this process, 1.7 busy with other work now (load 3.9)``."""
        busy = (
            "busy with other work: not measured here"
            if self.busy is None
            else f"{self.busy:.1f} busy with other work now"
        )
        load = f" (load {self.load:.1f})" if self.load is not None else ""
        quota = f" (a cgroup quota on {self.cpus} CPUs)" if self.cpus is not None and self.cpus > self.cores else ""
        return f"{self.cores} core(s) for this process{quota}, {busy}{load}"


def measure(window_s: float = WINDOW_S, launched: bool = False) -> Machine:
    """The machine now: :func:`available_cores`, :func:`busy_cores` over ``window_s`` (``launched``: a parallel
    launcher's job, its launch left out), the load average."""
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    busy = busy_cores(window_s, launched=launched) if window_s > 0 else None
    return Machine(available_cores(), None if busy is None else round(busy, 2), load, len(affinity()))


@dataclass(frozen=True)
class ThreadChoice:
    """The torch threads a job runs with, and why."""

    threads: int
    source: str
    """``threads`` (an integer given), ``OMP_NUM_THREADS``, ``cpus_per_task`` (a submitit job's) or ``auto``."""
    parallel: int = 1
    """The jobs that share the cores (joblib's ``n_jobs``)."""
    machine: Machine | None = None
    """The measurement the choice was made from (None when it took none: a given count)."""

    @property
    def reason(self) -> str:
        """One line: ``threads=4, given``, ``$OMP_NUM_THREADS=2``, ``threads=auto: 1 of 2 core(s) free ...``."""
        if self.source == "threads":
            return f"threads={self.threads}, given"
        if self.source == "OMP_NUM_THREADS":
            return f"$OMP_NUM_THREADS={self.threads}"
        if self.source == "cpus_per_task":
            return f"hydra.launcher.cpus_per_task={self.threads}, the cores the launcher gives each job"
        m = self.machine
        free = f"{m.free} of {m.cores} core(s) free" if m is not None else "1 core"
        shared = f", shared by {self.parallel} jobs at a time" if self.parallel > 1 else ""
        return f"threads=auto: {free}{shared}"


def _omp() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _given(setting: Any) -> int | None:
    if isinstance(setting, bool):
        return None
    if isinstance(setting, int) and setting > 0:
        return setting
    if isinstance(setting, str) and setting.strip().isdigit() and int(setting) > 0:
        return int(setting)
    return None


def choose_threads(
    machine: Machine | None, parallel: int = 1, setting: Any = "auto", cpus_per_task: int | None = None
) -> ThreadChoice:
    """The rule (module docstring), on a measurement already made: an integer ``setting`` (``threads=``), else
    ``$OMP_NUM_THREADS``, else ``cpus_per_task`` (a submitit job), else the ``machine``'s free cores divided
    among ``parallel`` jobs (at least 1; no ``machine``: :func:`available_cores`, unmeasured)."""
    given = _given(setting)
    if given is not None:
        return ThreadChoice(given, "threads", parallel, machine)
    omp = _omp()
    if omp is not None:
        return ThreadChoice(omp, "OMP_NUM_THREADS", parallel, machine)
    if cpus_per_task:
        return ThreadChoice(int(cpus_per_task), "cpus_per_task", parallel, machine)
    if machine is None:
        machine = Machine(available_cores(), None, None, len(affinity()))
    return ThreadChoice(max(1, machine.free // max(1, parallel)), "auto", max(1, parallel), machine)


def auto_threads(
    parallel: int = 1,
    setting: Any = "auto",
    cpus_per_task: int | None = None,
    launched: bool = False,
    window_s: float = WINDOW_S,
) -> ThreadChoice:
    """The threads a job of ``parallel`` run at once takes (:func:`choose_threads`), measuring the machine
    (:func:`measure`) only where the choice needs it (``threads=auto``, no ``$OMP_NUM_THREADS``, no
    ``cpus_per_task``). ``launched``: this process is a job that a parallel launcher started beside others."""
    if _given(setting) is None and _omp() is None and not cpus_per_task:
        return choose_threads(measure(window_s, launched=launched), parallel, setting)
    return choose_threads(None, parallel, setting, cpus_per_task)
