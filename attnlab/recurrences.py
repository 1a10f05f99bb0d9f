"""Decay and delta-rule attention under its names before 0.7, read through :mod:`attnlab.compat` (each name warns
and goes away in 1.0): the forms are :mod:`attnlab.forms.transitions` (RetNet, GLA, DeltaNet, Gated DeltaNet), their
math is :mod:`attnlab.transition` (one :class:`~attnlab.transition.Transition` record in place of ``log_alpha`` and
``beta``)."""

from attnlab.compat import forward, old_names

__all__ = old_names(__name__)  # (so that a star import still brings them, each with its warning)
__getattr__ = forward(__name__)
