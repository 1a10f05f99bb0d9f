"""The training entry points under their names before :mod:`attnlab.training`, read through :mod:`attnlab.compat`
(each name warns and goes away in 1.0)."""

import attnlab.training  # noqa: F401  (as before: importing this module registers training's Hydra resolvers)
from attnlab.compat import forward, old_names

__all__ = old_names(__name__)  # (so that a star import still brings them, each with its warning)
__getattr__ = forward(__name__)
