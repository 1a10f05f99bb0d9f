"""Hydra's entry to attnlab's tuned sweeper (``hydra/sweeper=tuned``): Hydra instantiates sweepers only from its
``hydra_plugins`` namespace package, so the class lives in :mod:`attnlab.training.tuned` and is named here.

Hydra imports this module when it scans its plugins, before it composes a config: it registers the default grid
(``hydra/sweeper/grid=default``, which conf/hydra/sweeper/tuned.yaml names) as a node that takes new keys, so that
both ``'hydra.sweeper.grid={lr:[1e-3,1e-2],model.weight_decay:[0,0.1]}'`` and ``hydra.sweeper.grid.lr=[...]``
compose (a YAML node would be closed to keys it does not list: "Key 'model.weight_decay' is not in struct")."""

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from attnlab.training.tuned import DEFAULT_GRID
from attnlab.training.tuned import TunedSweeper as _TunedSweeper


def _register_grid() -> None:
    node = OmegaConf.create({k: list(v) for k, v in DEFAULT_GRID.items()})
    OmegaConf.set_struct(node, False)  # (new keys, such as model.weight_decay, may be added to the grid)
    ConfigStore.instance().store(group="hydra/sweeper/grid", name="default", node=node, provider="attnlab")


_register_grid()


class TunedSweeper(_TunedSweeper):
    """See :class:`attnlab.training.tuned.TunedSweeper`."""
