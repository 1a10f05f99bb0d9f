"""Compiled kernels: fused CPU loops for the variants that PyTorch has no fused operator for.

* :mod:`attnlab.kernels.additive`: additive (Bahdanau) logits, forward and backward, without the (·, Lk, d_a)
  activation; built with the system C compiler on first use and cached.
"""
