"""Hydra's entry to attnlab's tuned sweeper (``hydra/sweeper=tuned``): Hydra instantiates sweepers only from its
``hydra_plugins`` namespace package, so the class lives in :mod:`attnlab.training.tuned` and is named here."""

from attnlab.training.tuned import TunedSweeper as _TunedSweeper


class TunedSweeper(_TunedSweeper):
    """See :class:`attnlab.training.tuned.TunedSweeper`."""
