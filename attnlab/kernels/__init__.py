"""Compiled kernels: fused CPU loops for the variants that PyTorch has no fused operator for, each one C file built
with the system C compiler on first use and cached (:mod:`attnlab.kernels.build`).

* :mod:`attnlab.kernels.additive`: additive (Bahdanau) logits, forward and backward, without the (·, Lk, d_a)
  activation.
* :mod:`attnlab.kernels.tiled`: FlashAttention-2 on the CPU (tiles, an online softmax, no (L, L) tensor), forward
  and backward, with a score modifier: a bias over offsets (T5, ALiBi, Shaw's key term), soft-capping, softmax,
  softmax1, sink, sigmoid, masks as key intervals and key padding.
* :mod:`attnlab.kernels.relative`: softmax attention with one learned relative-position table (Shaw, T5).
* :mod:`attnlab.kernels.softmax`: the row softmax with optional soft-capping, forward and backward in place.
* :mod:`attnlab.kernels.sparse`: sparsemax, 1.5-entmax and softpick over rows, exact, without a sort.
* :mod:`attnlab.kernels.conv`: the causal depthwise convolution (short convolution, Canon layers), shifted
  multiply-adds in plain torch with a written-out backward (every device).
* :mod:`attnlab.kernels.rows`: the row-operation interface (:class:`~attnlab.kernels.rows.RowOp`) the last two
  offer to the ``normalized`` backend.
"""
