"""Issue 61, honest plans on a busy machine: ``threads=auto`` takes the cores this process can really have (affinity,
cgroup quota, less what other work keeps busy now: :mod:`attnlab.cores`), one rule for the run and its plan; the
dry run says how busy the machine is and times at the run's thread count; ``--dry-run`` plans a SLURM sweep without
``srun`` and a GPU trainer without CUDA; a sweep's plan names the settings that differ between its jobs besides
the swept keys. The choice is tested with fake ``/proc`` and cgroup files and with a real load (busy-loop
processes), never by timing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from attnlab import cores
from attnlab.cores import Machine, Snapshot, busy_between, choose_threads

TINY = ("d_model=16", "num_heads=2", "num_layers=1", "debug=fast", "logger=none", "diagnostics.heatmaps=false")
FORMS = "variant=kda,gated_deltanet,deltaproduct,rwkv7,scaled_dot"


@pytest.fixture(autouse=True)
def _no_thread_settings(monkeypatch, tmp_path):
    """``$OMP_NUM_THREADS`` (which the test workers set) would win over every rule tested here; torch's threads
    and the step-time cache are left as they were."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _stat_line(cpu: int | str, user: int, system: int, idle: int, iowait: int = 0, steal: int = 0) -> str:
    return f"cpu{cpu} {user} 0 {system} {idle} {iowait} 0 0 {steal} 0 0"


def _proc_stat(*cpus: tuple[int, int, int]) -> str:
    """A ``/proc/stat`` text: the aggregate line, each CPU's (user, system, idle) ticks, and the other lines."""
    total = [sum(c[i] for c in cpus) for i in range(3)]
    lines = [_stat_line("", *total).replace("cpu ", "cpu  ", 1)]
    lines += [_stat_line(n, *c) for n, c in enumerate(cpus)]
    return "\n".join([*lines, "intr 1 2 3", "ctxt 42", "btime 1700000000", "processes 9", ""])


def _pid_stat(pid: int, ppid: int, ticks: int, name: str = "python (x) y") -> str:
    """A ``/proc/<pid>/stat`` line: a command name with spaces and parentheses, ``ticks`` of user time."""
    after = ["S", str(ppid), *["0"] * 9, str(ticks), "0", *["0"] * 8]
    return f"{pid} ({name}) " + " ".join(after)


# ------------------------------------------------------------------------------------------ /proc/stat, faked


def test_the_busy_cores_are_the_busy_ticks_of_this_processs_cpus_less_its_own():
    before = Snapshot({0: (100, 1000), 1: (100, 1000), 2: (0, 1000)}, {7: 50})
    # over 20 ticks per CPU: cpu0 busy all of them, cpu1 half, cpu2 (not ours) all; this process 5 ticks
    after = Snapshot({0: (120, 1020), 1: (110, 1020), 2: (20, 1020)}, {7: 55})
    assert busy_between(before, after, [0, 1]) == pytest.approx(1.5 - 5 / 20)
    assert busy_between(before, after) == pytest.approx(2.5 - 5 / 20)  # every CPU of the samples
    assert busy_between(before, after, [5]) == 0.0  # (a CPU the samples lack)
    idle = Snapshot({0: (100, 1020), 1: (100, 1020)}, {7: 80})  # this process's own ticks never go below 0 busy
    assert busy_between(before, idle, [0, 1]) == 0.0


def test_proc_stat_is_parsed_per_cpu_and_steal_is_busy_but_iowait_is_not():
    text = "\n".join([_stat_line("", 9, 9, 9), _stat_line(0, 10, 5, 80, iowait=5), _stat_line(1, 0, 0, 90, steal=10)])
    assert cores._cpu_ticks(text) == {0: (15, 100), 1: (10, 100)}


def test_busy_cores_samples_proc_stat_twice_over_the_window(tmp_path, monkeypatch):
    """The whole of :func:`busy_cores` on a fake ``/proc``: the second sample is written while it waits."""
    monkeypatch.setattr(cores, "PROC", tmp_path)
    monkeypatch.setattr(cores, "affinity", lambda: [0, 1])
    me = tmp_path / str(os.getpid())
    me.mkdir()
    (tmp_path / "stat").write_text(_proc_stat((1000, 0, 5000), (1000, 0, 5000), (0, 0, 6000)))
    (me / "stat").write_text(_pid_stat(os.getpid(), 1, 300))
    waited = []

    def sleep(seconds):  # 20 ticks a CPU: cpu0 and cpu2 all busy, cpu1 idle; this process 2 of cpu0's ticks
        waited.append(seconds)
        (tmp_path / "stat").write_text(_proc_stat((1020, 0, 5000), (1000, 0, 5020), (20, 0, 6000)))
        (me / "stat").write_text(_pid_stat(os.getpid(), 1, 302))

    busy = cores.busy_cores(0.2, sleep=sleep)
    assert waited == [0.2] and busy == pytest.approx(1.0 - 2 / 20)  # cpu2 is not this process's
    (tmp_path / "stat").unlink()
    assert cores.busy_cores(0.2, sleep=sleep) is None  # (no /proc/stat: macOS) not measured


def test_a_launched_jobs_busy_cores_leave_out_its_launchs_processes(tmp_path, monkeypatch):
    """A job that joblib started beside others: its siblings' work is the sweep's (shared out by dividing the
    cores), not other work; a process outside the launch is."""
    monkeypatch.setattr(cores, "PROC", tmp_path)
    monkeypatch.setattr(os, "getppid", lambda: 500)
    me = os.getpid()
    tree = {500: 1, me: 500, 501: 500, 502: 501, 900: 1}  # parent 500: this job, a sibling 501 and its child 502
    for pid, ppid in tree.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_pid_stat(pid, ppid, 10))
    assert cores.launch_pids() == {500, me, 501, 502}


# ------------------------------------------------------------------------------------------ cgroups and affinity


def _cgroup(tmp_path: Path, monkeypatch, self_cgroup: str, files: dict[str, str]) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(self_cgroup)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    monkeypatch.setattr(cores, "PROC", proc)
    monkeypatch.setattr(cores, "CGROUP", root)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})


def test_a_cgroup_v2_quota_caps_the_cores(tmp_path, monkeypatch):
    _cgroup(tmp_path, monkeypatch, "0::/\n", {"cpu.max": "150000 100000\n"})
    assert cores.cgroup_quota() == 1.5 and cores.available_cores() == 1  # threads beyond the quota are throttled


def test_a_cgroup_v2_quota_above_this_cgroup_caps_it_too(tmp_path, monkeypatch):
    files = {"cpu.max": "max 100000\n", "a/cpu.max": "300000 100000\n", "a/b/cpu.max": "max 100000\n"}
    _cgroup(tmp_path, monkeypatch, "0::/a/b\n", files)
    assert cores.cgroup_quota() == 3.0 and cores.available_cores() == 3


def test_no_quota_leaves_the_affinity(tmp_path, monkeypatch):
    _cgroup(tmp_path, monkeypatch, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cores.cgroup_quota() is None and cores.available_cores() == 8


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
def test_a_cgroup_v1_quota_caps_the_cores(tmp_path, monkeypatch, mount):
    files = {f"{mount}/cpu.cfs_quota_us": "250000\n", f"{mount}/cpu.cfs_period_us": "100000\n"}
    _cgroup(tmp_path, monkeypatch, "4:memory:/x\n1:cpu,cpuacct:/\n", files)
    assert cores.cgroup_quota() == 2.5 and cores.available_cores() == 2


def test_a_cgroup_v1_quota_of_minus_one_is_none(tmp_path, monkeypatch):
    files = {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}
    _cgroup(tmp_path, monkeypatch, "1:cpu:/\n", files)
    assert cores.cgroup_quota() is None and cores.available_cores() == 8


def test_the_affinity_counts_not_the_machines_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5})
    monkeypatch.setattr(cores, "cgroup_quota", lambda: None)
    assert cores.affinity() == [3, 5] and cores.available_cores() == 2


# ------------------------------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("cores_", "cpus", "busy", "parallel", "threads"),
    [
        (2, 2, 0.0, 1, 2),
        (2, 2, 0.4, 1, 2),  # a mostly idle machine keeps all its cores
        (2, 2, 0.6, 1, 1),
        (2, 2, 1.7, 1, 1),
        (2, 2, 2.0, 1, 1),  # never below 1
        (8, 8, 3.2, 2, 2),  # 5 free, 2 jobs at a time
        (8, 8, 0.0, 3, 2),
        (4, 64, 30.0, 1, 4),  # a quota of 4 on 64 CPUs, 30 of them busy: the quota binds
        (1, 64, 63.9, 1, 1),
    ],
)
def test_auto_takes_the_free_cores_shared_among_the_jobs_at_once(cores_, cpus, busy, parallel, threads):
    choice = choose_threads(Machine(cores_, busy, 1.0, cpus), parallel)
    assert choice.threads == threads and choice.source == "auto"


def test_omp_num_threads_and_an_explicit_count_win(monkeypatch):
    busy = Machine(2, 2.0, 4.0, 2)
    assert choose_threads(busy, 1, 3).reason == "threads=3, given"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(busy, 1, "auto").threads == 2 and choose_threads(busy, 1, "auto").source == "OMP_NUM_THREADS"
    assert choose_threads(busy, 1, 4).threads == 4  # the integer wins over the environment
    monkeypatch.setenv("OMP_NUM_THREADS", "0")  # (not a count: auto)
    assert choose_threads(busy, 1, "auto").threads == 1
    assert choose_threads(busy, 1, "auto", cpus_per_task=6).threads == 6  # what the launcher gives the job


def test_a_busy_machine_is_one_whose_other_work_holds_over_half_its_cores():
    assert Machine(2, 1.1, None, 2).is_busy and not Machine(2, 0.9, None, 2).is_busy
    assert not Machine(2, None, None, 2).is_busy  # (not measured)
    line = Machine(2, 1.7, 3.9, 2).describe()
    assert line == "2 core(s) for this process, 1.7 busy with other work now (load 3.9)"


def test_set_threads_and_the_plan_use_one_rule(monkeypatch):
    """The run (:func:`set_threads`) and its plan choose the same count from the same measurement."""
    from attnlab.training.config import set_threads
    from attnlab.training.plan import plan_command

    monkeypatch.setattr(cores, "affinity", lambda: [0, 1])
    monkeypatch.setattr(cores, "cgroup_quota", lambda: None)
    monkeypatch.setattr("attnlab.training.plan.step_time", lambda *a, **k: 0.01)  # (the count is tested, not time)
    for busy, threads in ((1.7, 1), (0.2, 2)):
        monkeypatch.setattr(cores, "busy_cores", lambda *a, busy=busy, **k: busy)
        assert set_threads(OmegaConf.create({"threads": "auto"})) == threads == torch.get_num_threads()
        plan = plan_command([*TINY, "--dry-run"])
        assert plan.threads == threads and plan.jobs[0].threads == threads and plan.machine.busy == busy
    assert set_threads(OmegaConf.create({"threads": 3})) == 3


def test_joblibs_n_jobs_and_submitits_cpus_per_task_share_the_cores(monkeypatch):
    from attnlab.training.config.compose import launcher_share

    monkeypatch.setattr(cores, "available_cores", lambda: 8)
    joblib = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    assert launcher_share(OmegaConf.create({"_target_": joblib, "n_jobs": -1})) == (8, None)
    assert launcher_share(OmegaConf.create({"_target_": joblib, "n_jobs": -2})) == (7, None)  # joblib's: all but one
    assert launcher_share(OmegaConf.create({"_target_": joblib, "n_jobs": 3})) == (3, None)
    slurm = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher_share(OmegaConf.create({"_target_": slurm, "cpus_per_task": 4})) == (1, 4)
    assert launcher_share(OmegaConf.create({"_target_": "hydra._internal.BasicLauncher"})) == (1, None)


def test_threads_beyond_four_per_available_core_are_refused_in_one_line(monkeypatch):
    from attnlab.training.config import ConfigError
    from attnlab.training.config.validate import _check_threads, planned_elsewhere

    monkeypatch.setattr(cores, "available_cores", lambda: 2)
    _check_threads(8)
    with pytest.raises(
        ConfigError, match=r"^threads must be auto or an integer from 1 to 8 \(4 per core here\), got 9$"
    ):
        _check_threads(9)
    with planned_elsewhere():  # (a SLURM job's threads are its node's business)
        _check_threads(64)
        with pytest.raises(ConfigError, match=r"^threads must be auto or an integer >= 1, got 0$"):
            _check_threads(0)


# ------------------------------------------------------------------------------------------ a real load


def _busy_loops(n: int) -> list[subprocess.Popen]:
    """``n`` processes that spin on a core each, running once each has used some CPU (waited for, not timed)."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ticks = cores._ticks_of(p.pid for p in loops)
        if len(ticks) == n and all(t > 0 for t in ticks.values()):
            break
        time.sleep(0.05)
    return loops


def _stop(loops: list[subprocess.Popen]) -> None:
    for p in loops:
        p.kill()
    for p in loops:
        p.wait(timeout=30)


def _needs_proc_stat() -> None:
    if cores.snapshot() is None:
        pytest.skip("no /proc/stat here: the busy cores cannot be measured")
    quota = cores.cgroup_quota()
    if quota is not None and quota < len(cores.affinity()):  # (busy loops under a quota cannot fill every CPU)
        pytest.skip(f"a cgroup quota of {quota} cores on {len(cores.affinity())} CPUs")


@pytest.mark.slow
def test_a_real_load_on_every_core_makes_auto_pick_one_thread_and_the_plan_say_so(capsys):
    """One busy loop per core: ``threads=auto`` takes 1 thread (before issue 61: every core), and the dry run
    times at it and prints the machine's line and the busy-machine note."""
    from attnlab.training.plan import dry_run

    _needs_proc_stat()
    loops = _busy_loops(len(cores.affinity()))
    try:
        choice = cores.auto_threads()
        assert choice.threads == 1 and choice.machine.is_busy, choice
        assert dry_run([*TINY, "--dry-run"]) == 0
    finally:
        _stop(loops)
    out = capsys.readouterr().out
    assert "busy with other work now" in out and "the job will run with 1 thread(s)" in out
    assert "note: this machine is busy: other work takes" in out
    assert "wait for the other work to end" in out and "threads=auto chose 1 thread a job already" in out


@pytest.mark.slow
def test_a_sweep_on_a_busy_machine_suggests_fewer_parallel_jobs(capsys, monkeypatch):
    from attnlab.training.plan import dry_run

    _needs_proc_stat()
    monkeypatch.setattr("attnlab.training.plan.step_time", lambda *a, **k: 0.01)  # (the advice is tested)
    loops = _busy_loops(len(cores.affinity()))
    try:
        args = ["-m", *TINY, "seed=0,1", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "threads=2", "--dry-run"]
        assert dry_run(args) == 0
    finally:
        _stop(loops)
    out = capsys.readouterr().out
    assert "run with threads=1" in out and "run fewer jobs at once (hydra.launcher.n_jobs=1)" in out
    assert "jobs 0, 1 run with 2 thread(s) each, 2 jobs at a time (threads=2, given), more than the 1 core(s)" in out


# ------------------------------------------------------------------------------------------ machines we are not on


def test_a_gpu_trainer_is_planned_without_cuda_counted_but_not_timed(capsys, monkeypatch):
    from attnlab.training.config import ConfigError, validate_config
    from attnlab.training.plan import dry_run, plan_command

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU job is timed as any other")
    for trainer in ("trainer=gpu", "trainer=gpu_bf16", "trainer.accelerator=gpu"):
        plan = plan_command([*TINY, trainer, "--dry-run"])
        (job,) = plan.jobs
        assert job.error is None and job.gpu and job.steps == 5 and job.tokens == 5 * 16 * 64, trainer
        assert job.flops_per_step and job.step_s is None and job.seconds is None
    assert dry_run([*TINY, "trainer=gpu_bf16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "estimated: no time" in out and "job 0 trains on a GPU (trainer.accelerator=gpu)" in out
    assert "its time cannot be estimated here" in out
    from attnlab.training.plan import _compose

    cfg = _compose([*TINY, "trainer=gpu"])  # the run itself still refuses it, in one line
    with pytest.raises(ConfigError, match="torch sees no CUDA GPU on this machine"):
        validate_config(cfg)


def _no_srun(monkeypatch) -> None:
    import shutil

    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "srun" else which(name, *a, **k))


def test_a_slurm_sweep_is_planned_without_srun_with_its_sbatch_settings(capsys, monkeypatch):
    from attnlab.training.plan import dry_run

    _no_srun(monkeypatch)  # (no srun, whatever the machine)
    monkeypatch.setattr("attnlab.training.plan.step_time", lambda *a, **k: 0.01)
    args = ["-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "variant=dot,scaled_dot", *TINY]
    assert dry_run([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "a sweep of 2 job(s)" in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("slurm: each job is one sbatch job:")]
    for setting in ("partition=gpu", "timeout_min=60", "cpus_per_task=4", "gpus_per_node=1", "mem_gb=16"):
        assert setting in line
    assert "array_parallelism=64" in line and "submitit_folder" not in line
    assert "the jobs will run on the SLURM cluster with 4 thread(s) each" in out
    assert "note: the jobs run on the SLURM cluster, not here: each job's time is estimated on this machine" in out
    free = cores.measure().free
    if free < 4:  # (this machine has fewer cores free than the job's cpus_per_task: timed with what it has)
        assert "timed here with" in out and "cannot be timed as the cluster runs it" in out
    assert "trainer=auto trains on it there" in out  # (gpus_per_node=1: the times here are a CPU's)


def test_a_slurm_dry_run_through_the_command_line_needs_no_srun(tmp_path, monkeypatch):
    from helpers import run_cli

    _no_srun(monkeypatch)
    monkeypatch.setattr("attnlab.training.plan.step_time", lambda *a, **k: 0.01)
    proc = run_cli("-m", "hydra/launcher=slurm", "variant=dot,scaled_dot", *TINY, "--dry-run", cwd=tmp_path,
                   returncode=0, ATTNLAB_CACHE_DIR=str(tmp_path / "c"))  # fmt: skip
    assert "slurm: each job is one sbatch job:" in proc.stdout and not (tmp_path / "multirun").exists()


_WITHOUT_SUBMITIT = """
import sys
sys.modules["hydra_plugins.hydra_submitit_launcher"] = None  # (find_spec and Hydra's plugin scan: not installed)
from attnlab.training.{module} import {function}
sys.exit({function}({argv!r}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("module", "function"), [("plan", "dry_run"), ("cli", "main")])
def test_a_slurm_plan_without_the_submitit_plugin_says_so_in_one_line(tmp_path, module, function):
    """A fresh interpreter where the optional plugin cannot be imported (in this one, Hydra has registered its
    configs already): the plan, and the command line that runs it, say so in one line and exit 2."""
    argv = ["-m", "hydra/launcher=slurm", "variant=dot,scaled_dot", *TINY, "--dry-run"]
    code = _WITHOUT_SUBMITIT.format(module=module, function=function, argv=argv)
    env = {**os.environ, "ATTNLAB_CACHE_DIR": str(tmp_path / "c")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and err.count("\n") == 0, err
    assert err.startswith("error: hydra/launcher=slurm needs the slurm extra") and "pip install -e '.[slurm]'" in err


# ------------------------------------------------------------------------------------------ what differs between jobs


def test_the_five_forms_sweep_names_the_settings_that_differ_besides_the_variant(capsys, monkeypatch):
    """``-m variant=kda,gated_deltanet,deltaproduct,rwkv7,scaled_dot task=parity --dry-run``: the presets set
    ``model.short_conv`` (kda 4, deltaproduct 4, rwkv7 2, gated_deltanet none) and the normalizer; the plan says so,
    and leaves out the variant itself and each form's own parameters."""
    from attnlab.training.plan import dry_run, plan_command

    monkeypatch.setattr("attnlab.training.plan.step_time", lambda *a, **k: 0.01)  # (the settings are tested)
    monkeypatch.setattr("attnlab.training.plan._flops", lambda *a, **k: None)
    argv = ["-m", FORMS, "task=parity", "--dry-run"]
    plan = plan_command(argv)
    differing = plan.differing
    forms = ["kda", "gated_deltanet", "deltaproduct", "rwkv7", "scaled_dot"]
    assert differing["short_conv"] == dict(zip(forms, ["4", "none", "4", "2", "none"], strict=True))
    assert differing["normalizer"] == dict(zip(forms, ["none"] * 4 + ["softmax"], strict=True))
    assert not {"score", "score_params"} & set(differing)
    assert not any(k.startswith(("variant", "hydra", "model.short_conv")) for k in differing)
    assert dry_run(argv) == 0
    out = capsys.readouterr().out
    assert (
        "note: settings that differ between the jobs besides the swept keys: " in out
        and "short_conv [model.short_conv] (kda 4, gated_deltanet none, deltaproduct 4, rwkv7 2, scaled_dot none)"
        in out
    )


def test_differing_settings_leaves_out_the_swept_keys_and_sees_per_layer_changes():
    from attnlab.training.plan import _compose, differing_settings

    jobs = {
        "kda": _compose(["variant=kda"]),
        "sd": _compose(["variant=scaled_dot", "model.d_ff=96"]),
        "kda_gs": _compose(["variant=kda", "model.pattern=GS"]),  # 2 layers: kda, then a scaled_dot softmax layer
    }
    found = differing_settings(jobs, swept=["variant"])
    assert found["short_conv"] == {"kda": "4", "sd": "none", "kda_gs": "4 / none"}
    assert found["normalizer"] == {"kda": "none", "sd": "softmax", "kda_gs": "none / softmax"}
    assert found["model.d_ff"] == {"kda": "none", "sd": "96", "kda_gs": "none"}
    assert found["model.pattern"] == {"kda": "none", "sd": "none", "kda_gs": "GS"}
    assert "score" not in found and "score_params" not in found  # (the form's own: left out, per layer too)
    assert "short_conv" not in differing_settings(jobs, swept=["variant", "model.short_conv"])
    assert differing_settings({"one": jobs["kda"]}) == {}
    lrs = {"a": _compose(["variant=kda", "lr=1e-3"]), "b": _compose(["variant=kda", "lr=1e-2"])}
    assert differing_settings(lrs) == {"lr": {"a": "0.001", "b": "0.01"}}  # (not swept here: said)
    assert differing_settings(lrs, swept=["lr"]) == {}


def test_hydras_error_for_a_missing_plugins_config_becomes_one_line_naming_the_choice():
    from attnlab.training.plan import missing_plugin

    error = "In 'hydra/config': Could not find 'hydra/sweeper/optuna' Available options in 'hydra/sweeper': basic tuned"
    line = missing_plugin(error, ["hparams_search=optuna", "lr=1e-3"])
    assert line.startswith("hparams_search=optuna needs the optuna extra") and "pip install -e '.[optuna]'" in line
    assert missing_plugin("In 'x': Could not load 'hydra/launcher/submitit_local'", ["hydra/launcher=local"]) == (
        "hydra/launcher=local needs the slurm extra (hydra-submitit-launcher), which is not installed here: pip "
        "install -e '.[slurm]' (the plan reads the launcher's settings from it; no cluster is needed)"
    )
    assert missing_plugin("Could not override 'd_kk'", []) is None


def test_under_a_quota_busy_cpus_beyond_it_take_nothing():
    """A process with a quota of 4 cores on 64 CPUs: 10 busy CPUs leave its 4 cores free, so the machine is not
    busy for it and it keeps 4 threads; 62 busy CPUs take 2 of its 4 (busy); on 2 cores, 1.7 busy takes 1.7."""
    from attnlab.cores import Machine

    roomy = Machine(cores=4, busy=10.0, cpus=64)
    assert (roomy.free, roomy.taken, roomy.is_busy) == (4, 0.0, False)
    tight = Machine(cores=4, busy=62.0, cpus=64)
    assert tight.free == 2 and tight.taken == pytest.approx(2.0) and not tight.is_busy  # (half: not more than)
    assert Machine(cores=4, busy=63.0, cpus=64).is_busy
    laptop = Machine(cores=2, busy=1.7)
    assert laptop.free == 1 and laptop.taken == pytest.approx(1.7) and laptop.is_busy
