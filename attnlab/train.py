"""The Hydra entry point: compose ``conf/``, seed, build the task and the module, fit, test with the best
checkpoint, write the run files, and return the optimized metric (for Hydra sweepers).

    python train.py variant=additive d_k=64 num_heads=1
    python train.py -m variant=additive,dot,scaled_dot d_k=8,64,512 num_heads=1,4

Every run folder ends with ``config.yaml`` (resolved), ``metrics.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import secrets
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.utils.data import DataLoader, DistributedSampler

from attnlab.callbacks import AttentionDiagnostics, DivergenceError, DivergenceGuard
from attnlab.module import EncoderModule
from attnlab.tracking import SUMMARY_FILE, JsonlLogger, write_json_atomic
from attnlab.validate import ConfigError, check_group_choices, validate_config

__all__ = ["CONF_DIR", "ResumableDataLoader", "SweepReport", "build_module", "hydra_main", "main", "resolve_d_k", "run"]

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# Lightning's own deprecation noise (torch's pytree API), not actionable by users.
warnings.filterwarnings("ignore", message=r".*treespec.*")
# val/acc_best is a MaxMetric's compute(), already reduced over all processes: no sync_dist needed.
warnings.filterwarnings("ignore", message=r".*self\.log\('val/acc_best', \.\.\., sync_dist=True\).*")


def _launch_uid() -> str:
    """A random id drawn once per launch and inherited by the jobs it starts (through the environment)."""
    uid = os.environ.get("ATTNLAB_UID")
    if not uid:
        uid = os.environ["ATTNLAB_UID"] = secrets.token_hex(3)
    return uid


# cached in the config, so that a job that composes its config again (submitit, joblib) gets the launch's id even
# where the environment is not passed on (sbatch --export=NONE)
OmegaConf.register_new_resolver("attnlab_uid", _launch_uid, replace=True, use_cache=True)


def resolve_d_k(cfg: DictConfig) -> int:
    """``d_k`` or, when it is null, ``d_model // num_heads`` (which must then divide evenly)."""
    if cfg.d_k is not None:
        return int(cfg.d_k)
    if cfg.d_model % cfg.num_heads:
        raise ValueError(f"d_model ({cfg.d_model}) is not divisible by num_heads ({cfg.num_heads}); set d_k explicitly")
    return cfg.d_model // cfg.num_heads


def set_threads(cfg: DictConfig) -> int:
    """Set torch's CPU threads from ``cfg.threads``: an integer, or ``auto`` = ``$OMP_NUM_THREADS`` when set, else
    all cores divided among the jobs that a parallel launcher (joblib) runs at once, so that two jobs on two cores
    do not fight over four threads, or a submitit job's ``cpus_per_task``."""
    threads = cfg.get("threads", "auto")
    if threads in (None, "auto") and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = int(os.environ["OMP_NUM_THREADS"])
    if threads in (None, "auto"):
        cores = os.cpu_count() or 1
        parallel = 1
        if HydraConfig.initialized():
            launcher = HydraConfig.get().launcher
            target = str(launcher.get("_target_", "")).lower()
            if "joblib" in target:
                n_jobs = launcher.get("n_jobs", -1) or -1
                parallel = cores if n_jobs < 0 else n_jobs
            elif "submitit" in target and launcher.get("cpus_per_task"):
                cores = int(launcher.cpus_per_task)  # what SLURM gave the job (submitit: cpus_per_task)
        threads = max(1, cores // max(1, parallel))
    torch.set_num_threads(int(threads))
    return int(threads)


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def build_module(cfg: DictConfig, datamodule: Any) -> EncoderModule:
    """The EncoderModule for ``cfg`` sized to the task ``datamodule``."""
    m = cfg.model
    return EncoderModule(
        vocab_size=datamodule.vocab_size,
        num_classes=datamodule.num_classes,
        per_token=datamodule.per_token,
        pad_id=datamodule.pad_id,
        max_len=datamodule.max_len,
        d_model=cfg.d_model,
        num_heads=cfg.num_heads,
        num_layers=cfg.num_layers,
        d_k=resolve_d_k(cfg),
        d_v=m.d_v,
        d_ff=m.d_ff,
        score=cfg.variant.name,
        score_params=_plain(cfg.variant.get("params")) or {},
        mask=_plain(cfg.mask),
        pos_encoding=m.pos_encoding,
        norm_first=m.norm_first,
        dropout=m.dropout,
        lr=cfg.lr,
        weight_decay=m.weight_decay,
        warmup_steps=min(m.warmup_steps, max(1, cfg.max_steps // 5)),
        max_steps=cfg.max_steps,
        betas=tuple(m.betas),
    )


class ResumableDataLoader(DataLoader):
    """A training DataLoader that continues an interrupted pass over the data where it stopped.

    Lightning saves its ``state_dict`` in every checkpoint and loads it on resume: the shuffle generator's state at
    the start of the current pass and the number of batches handed out in it. After a load, the next pass starts
    from that generator state (the same order as the interrupted pass) and skips the batches already trained on,
    so a resumed run sees exactly the batches an uninterrupted run would. (Lightning's training loop does not
    prefetch from a loader with a length, so "handed out" is "trained on".)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pass_rng: torch.Tensor | None = None
        self._yielded = 0
        self._pending: tuple[torch.Tensor | None, int] | None = None

    @classmethod
    def like(cls, loader: DataLoader) -> ResumableDataLoader:
        """The same loader (dataset, sampler, generator, workers, ...) made resumable."""
        kwargs = _loader_kwargs(loader)
        if loader.batch_size is None:  # a custom batch sampler
            kwargs["batch_sampler"] = loader.batch_sampler
        else:
            kwargs.update(batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last)
        return cls(loader.dataset, **kwargs)

    def __iter__(self) -> Any:
        rng, skip = self._pending or (None, 0)
        self._pending = None
        if self.generator is not None:
            if rng is not None:
                self.generator.set_state(rng)
            self._pass_rng = self.generator.get_state()
        iterator = super().__iter__()
        self._yielded = 0
        for _ in range(skip):  # at once, not lazily: Lightning may drop this iterator without drawing from it
            if next(iterator, None) is None:
                break
            self._yielded += 1
        return self._count(iterator)

    def _count(self, iterator: Any) -> Any:
        for batch in iterator:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"pass_rng": self._pass_rng, "yielded": self._yielded}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = (state_dict.get("pass_rng"), int(state_dict.get("yielded", 0)))


def _loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """A DataLoader's arguments other than the dataset and what picks the batches."""
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kwargs.update(prefetch_factor=loader.prefetch_factor, multiprocessing_context=loader.multiprocessing_context)
    return kwargs


def _every_sample_once(loader: Any) -> Any:
    """With several processes, an evaluation loader that gives each rank every world-size-th sample, none twice
    (Lightning's default DistributedSampler pads the last round with repeated samples, which skews val/test metrics
    when the split is not a multiple of the world size); unchanged otherwise."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return loader
    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        return loader
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    sampler = UnrepeatedDistributedSampler(
        loader.dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=False
    )
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, **_loader_kwargs(loader))


def _train_loader(make: Any, datamodule: Any) -> Any:
    loader = make(datamodule)
    is_plain = isinstance(loader, DataLoader) and not isinstance(loader, ResumableDataLoader)
    return ResumableDataLoader.like(loader) if is_plain else loader


def _eval_loader(make: Any, datamodule: Any) -> Any:
    return _every_sample_once(make(datamodule))


def _prepare_loaders(datamodule: Any) -> None:
    """Route the datamodule's training loader through :class:`ResumableDataLoader` and, in distributed runs, its
    validation and test loaders through :func:`_every_sample_once` (partials of module functions, so that the
    datamodule still pickles for ``ddp_spawn``)."""
    cls = type(datamodule)
    for hook, wrap in (
        ("train_dataloader", _train_loader),
        ("val_dataloader", _eval_loader),
        ("test_dataloader", _eval_loader),
    ):
        if is_overridden(hook, datamodule, L.LightningDataModule):
            setattr(datamodule, hook, functools.partial(wrap, getattr(cls, hook), datamodule))


class _RunState(L.Callback):
    """What a resumed run needs beyond Lightning's own checkpoint contents, saved in every checkpoint: the row count
    of metrics.jsonl (rows logged after the checkpoint are dropped on resume, whatever their step) and the best
    validation accuracy so far (the module's ``val_acc_best`` MaxMetric is not part of its state_dict)."""

    def __init__(self, jsonl: JsonlLogger) -> None:
        self.jsonl = jsonl
        self.val_acc_best: float | None = None
        self._restore: float | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get("val/acc_best")
        if value is not None and not trainer.sanity_checking:
            self.val_acc_best = float(value)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        best = getattr(pl_module, "val_acc_best", None)
        if self._restore is not None and best is not None:
            self.val_acc_best = self._restore
            best.update(torch.tensor(self._restore, device=pl_module.device))
        self._restore = None

    def state_dict(self) -> dict[str, Any]:
        return {"metrics_rows": self.jsonl.rows, "val_acc_best": self.val_acc_best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # applied when training starts (Lightning also loads callback states for trainer.test(ckpt_path=...))
        self._restore = state_dict.get("val_acc_best")


def _wandb_logger(cfg: DictConfig, out: Path, resume: bool = False) -> Any:
    """A WandbLogger whose files live in the run folder, offline unless asked otherwise, grouped by sweep, with
    the variant as job type, a name built from the overrides and the full resolved config."""
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    group, name = None, out.name
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        name = hc.job.override_dirname or name
        if hc.mode == RunMode.MULTIRUN:
            group = Path(hc.sweep.dir).name
    lc = cfg.logger
    id_file = out / "wandb_id.txt"
    if (resume or rank_zero_only.rank != 0) and id_file.exists():
        run_id = id_file.read_text().strip()  # continue the same W&B run (other ranks never start one)
    else:
        run_id = secrets.token_hex(4)
        if rank_zero_only.rank == 0:
            id_file.write_text(run_id + "\n")
    return WandbLogger(
        id=run_id,
        resume="allow",
        project=lc.project,
        entity=lc.get("entity"),
        save_dir=str(out),
        name=name,
        group=group,
        job_type=cfg.variant.name,
        mode=lc.mode,
        tags=list(lc.get("tags") or []),
        config=OmegaConf.to_container(cfg, resolve=True),
        settings=wandb.Settings(console="off", silent=True),
    )


def _loggers(cfg: DictConfig, out: Path, resume: bool = False) -> list[Any]:
    """The local JSONL logger, always, plus the configured one."""
    loggers: list[Any] = [JsonlLogger(out)]
    name = cfg.logger.name
    if name == "csv":
        loggers.append(CSVLogger(save_dir=str(out), name="csv", version=""))
    elif name == "wandb":
        loggers.append(_wandb_logger(cfg, out, resume))
    elif name != "none":
        raise ValueError(f"unknown logger '{name}'; allowed: wandb, csv, none")
    return loggers


def _finish_wandb(failed: bool) -> None:
    """Close this job's W&B run (if any) so the next job of a sweep never reuses it."""
    if "wandb" not in sys.modules:
        return
    import wandb

    if wandb.run is not None:
        wandb.finish(exit_code=1 if failed else 0)


def _summary_base(cfg: DictConfig) -> dict[str, Any]:
    return {
        "status": "running",
        "reason": None,
        "variant": cfg.variant.name,
        "mask": cfg.mask.name,
        "task": cfg.task.name,
        "d_k": cfg.d_k if cfg.d_k is not None else (cfg.d_model // max(1, cfg.num_heads)),
        "num_heads": cfg.num_heads,
        "d_model": cfg.d_model,
        "num_layers": cfg.num_layers,
        "seed": cfg.seed,
        "lr": cfg.lr,
        "batch_size": cfg.batch_size,
        "max_steps": cfg.max_steps,
        "pos_encoding": cfg.model.pos_encoding,
        "variant_params": _plain(cfg.variant.get("params")) or {},
    }


def _metric_values(trainer: L.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}


def print_results(summary: dict[str, Any]) -> None:
    """The short results table printed at the end of a run."""
    from rich.console import Console
    from rich.table import Table

    metrics = summary.get("metrics", {})
    table = Table(title=f"attnlab · {summary['task']} · {summary['status']}", title_justify="left")
    for col in ("variant", "d_k", "heads", "params", "best val acc", "test acc", "wall time"):
        table.add_column(col, justify="right" if col != "variant" else "left")

    def pct(key: str) -> str:
        v = metrics.get(key)
        return "-" if v is None else f"{100 * v:.1f}%"

    table.add_row(
        str(summary["variant"]),
        str(summary["d_k"]),
        str(summary["num_heads"]),
        f"{summary.get('params', 0):,}",
        pct("val/acc_best"),
        pct("test/acc"),
        f"{summary.get('wall_time_s', 0):.1f} s",
    )
    Console().print(table)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, ConfigError | DivergenceError) else f"{type(exc).__name__}: {text}"


def _is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _failed_value() -> float:
    """What a failed job returns to Hydra: the worst value for the sweeper's ``direction`` (Optuna 2.x stops the
    whole sweep on NaN: it rejects the value, then the sweeper's own error handling raises), else NaN."""
    direction = None
    if HydraConfig.initialized():
        direction = HydraConfig.get().sweeper.get("direction")
        if isinstance(direction, ListConfig | list | tuple):
            direction = direction[0] if len(direction) == 1 else None
    direction = str(getattr(direction, "name", direction)).lower()
    return {"maximize": float("-inf"), "minimize": float("inf")}.get(direction, float("nan"))


def _check_launch(trainer: L.Trainer) -> None:
    """Refuse a multi-process trainer that Lightning would start by re-running the command line inside a ``-m``
    sweep: every extra process would start the whole sweep again."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if (
        _is_multirun()
        and isinstance(launcher, _SubprocessScriptLauncher)
        and not launcher.cluster_environment.creates_processes_externally
        and launcher.num_processes > 1
    ):
        raise ConfigError(
            f"a {type(trainer.strategy).__name__} trainer with {launcher.num_processes} devices cannot run in a "
            "-m sweep (Lightning starts the other processes by re-running the command line); run it as a single "
            "run, or sweep with hydra/launcher=slurm and hydra.launcher.tasks_per_node=<devices>"
        )


def _resume_checkpoint(cfg: DictConfig, out: Path) -> str | None:
    """``resume=true`` or ``ckpt_path=last`` → the run folder's last.ckpt; ``ckpt_path=<file>`` → that file."""
    path = cfg.get("ckpt_path")
    if cfg.get("resume") or path == "last":
        path = out / "checkpoints" / "last.ckpt"
        if not path.exists():
            raise ConfigError(
                f"resume=true but there is no checkpoint at {path}; pass the run folder with hydra.run.dir=<folder>"
            )
    if path is not None and not Path(path).exists():
        raise ConfigError(f"ckpt_path {path} does not exist")
    return None if path is None else str(path)


def _resume_rows(path: str) -> tuple[int, int | None]:
    """(global step, metrics.jsonl row count) recorded in a checkpoint (the count is None in foreign ones)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    state = ckpt.get("callbacks", {}).get(_RunState.__qualname__) or {}
    return int(ckpt["global_step"]), state.get("metrics_rows")


def run(cfg: DictConfig, output_dir: str | Path | None = None) -> float:
    """Train and test one configuration; write ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` into
    ``output_dir`` (default: Hydra's run folder). Returns ``cfg.optimized_metric``.

    Any failure (a bad config, a diverged loss, any other exception) ends the run with ``status: failed`` and its
    reason in summary.json, a failed W&B run, and one line on stderr. In a multirun the job then returns NaN so that
    the sweep goes on; a single run exits with code 2 (bad config) or 1 (anything else).
    ``HYDRA_FULL_ERROR=1`` re-raises with the traceback.
    """
    start = time.perf_counter()
    out = Path(output_dir) if output_dir is not None else Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # With several processes (trainer=ddp: Lightning starts one per device by re-running the command line; SLURM:
    # one task per device) every process runs this function: only rank 0 writes the run files and the W&B run.
    writer = rank_zero_only.rank == 0
    if writer:
        OmegaConf.save(cfg, out / "config.yaml", resolve=True)
    summary = _summary_base(cfg)
    summary["run_dir"] = str(out)
    summary["launch_id"] = os.environ.get("ATTNLAB_UID")
    trainer = None
    try:
        for module_name in cfg.get("imports") or []:
            importlib.import_module(module_name)
        validate_config(cfg)
        ckpt_path = _resume_checkpoint(cfg, out)
        summary["threads"] = set_threads(cfg)
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        try:
            datamodule = instantiate(cfg.task.datamodule)
            datamodule.setup("fit")
            _prepare_loaders(datamodule)
        except InstantiationException as exc:
            raise ConfigError(_one_line(exc.__cause__ or exc)) from exc
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        module = build_module(cfg, datamodule)
        summary["d_k"] = module.hparams.d_k
        summary["params"] = module.num_parameters

        # best.ckpt when val/acc improves; last.ckpt at every validation (Lightning's save_last writes it only
        # when the best one is written)
        checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", filename="best", monitor="val/acc", mode="max")
        last = ModelCheckpoint(dirpath=out / "checkpoints", filename="last", enable_version_counter=False)
        loggers = _loggers(cfg, out, resume=ckpt_path is not None)
        callbacks: list[Any] = [_RunState(loggers[0]), checkpoint, last, DivergenceGuard()]
        diagnostics = None
        if cfg.diagnostics.enabled:
            d = cfg.diagnostics
            diagnostics = AttentionDiagnostics(d.every_n_steps, d.probe_size, d.threshold, d.heatmaps, out)
            callbacks.append(diagnostics)
        if ckpt_path is None:
            loggers[0].truncate(0)  # a new run starts its metrics anew
        else:
            step, rows = _resume_rows(ckpt_path)
            if rows is not None:
                loggers[0].truncate(rows)
            else:
                loggers[0].truncate_from(step + 1)
            summary["resumed_from"] = ckpt_path
            summary["resumed_at_step"] = step
        if cfg.logger.name == "wandb":
            summary["wandb_id"] = loggers[-1].version
        trainer = instantiate(cfg.trainer, logger=loggers, callbacks=callbacks, default_root_dir=str(out))
        _check_launch(trainer)
        summary["device"] = str(trainer.strategy.root_device)
        summary["world_size"] = trainer.world_size
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        fit_metrics = _metric_values(trainer)
        best = checkpoint.best_model_path or None
        trainer.test(module, datamodule=datamodule, ckpt_path=best, verbose=False, weights_only=True)
    except Exception as exc:
        _finish_wandb(failed=True)
        reason = _one_line(exc)
        summary.update(status="failed", reason=reason, wall_time_s=time.perf_counter() - start)
        if trainer is not None:
            summary.update(steps=trainer.global_step, metrics=_metric_values(trainer))
        if writer:
            write_json_atomic(out / SUMMARY_FILE, summary)
        print(f"error: {reason}", file=sys.stderr, flush=True)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if _is_multirun() or output_dir is not None:
            return _failed_value()
        raise SystemExit(2 if isinstance(exc, ConfigError) else 1) from None
    _finish_wandb(failed=False)
    writer = trainer.is_global_zero

    metrics = {**fit_metrics, **_metric_values(trainer)}
    if "val/acc_best" not in metrics and "val/acc" in metrics:
        metrics["val/acc_best"] = metrics["val/acc"]
    if diagnostics is not None:
        metrics.update(diagnostics.model_means(diagnostics.final))
        summary["attn_init"] = diagnostics.model_means(diagnostics.initial)
    summary.update(
        status="ok",
        metrics=metrics,
        steps=trainer.global_step,
        best_checkpoint=best,
        wall_time_s=time.perf_counter() - start,
        torch=torch.__version__,
    )
    if writer:
        write_json_atomic(out / SUMMARY_FILE, summary)
        if cfg.get("results_table", True):
            print_results(summary)
    return float(metrics.get(cfg.optimized_metric, float("nan")))


class SweepReport(Callback):
    """A Hydra callback: at the end of a multirun, print how many jobs finished ok and which failed (with why)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        ok, failed = [], []
        for path in sorted(sweep.glob("*/summary.json")):
            try:
                summary = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                summary = {"status": "failed", "reason": "unreadable summary.json"}
            (ok if summary.get("status") == "ok" else failed).append((path.parent.name, summary.get("reason")))
        print(f"sweep {sweep}: {len(ok)} ok, {len(failed)} failed", flush=True)
        for name, reason in failed:
            print(f"  failed: {name}: {reason}", flush=True)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg: DictConfig) -> float:
    """The Hydra task function."""
    return run(cfg)


# command-line choices that need an optional Hydra plugin: (group, choice) -> (plugin module, extra)
_PLUGINS = {
    ("hparams_search", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
    ("hydra/sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
    **{
        ("hydra/launcher", name): ("hydra_plugins.hydra_submitit_launcher", "slurm")
        for name in ("slurm", "local", "submitit_slurm", "submitit_local")
    },
}


def check_plugins(overrides: list[str]) -> None:
    """One line, not Hydra's composition error, when a choice needs a plugin that is not installed."""
    import importlib.util

    for arg in overrides:
        key, _, value = arg.partition("=")
        key = key.lstrip("+~").removeprefix("override ").strip()
        plugin = _PLUGINS.get((key, value.strip()))
        if plugin is not None and importlib.util.find_spec(plugin[0]) is None:
            raise ConfigError(f"{key}={value} needs the {plugin[1]} extra: pip install -e '.[{plugin[1]}]'")


def main() -> None:
    """``python train.py ...`` (and the ``attnlab-train`` console script): see the README for the knobs.

    Config group choices on the command line are checked before Hydra composes, so a typo costs one line."""
    try:
        check_group_choices(sys.argv[1:], CONF_DIR)
        check_plugins(sys.argv[1:])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    hydra_main()
