"""Data loaders for training: a training loader that resumes mid-pass exactly, and evaluation loaders that see every
sample once in distributed runs.

:func:`prepare_loaders` routes a datamodule's loaders through both (a no-op for a single process' evaluation).
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["ResumableDataLoader", "prepare_loaders"]


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


def prepare_loaders(datamodule: Any) -> None:
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
