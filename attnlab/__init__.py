"""attnlab: a lab bench for comparing attention mechanisms.

The public API: score and mask registries, multi-head attention with a free per-head key size, and the encoder.
"""

from attnlab.attention import AttentionOutput, MultiHeadAttention, PreparedMask, prepare_mask
from attnlab.encoder import (
    Encoder,
    EncoderLayer,
    LearnedPositionalEncoding,
    SinusoidalPositionalEncoding,
)
from attnlab.masks import Mask, build_mask, list_masks, register_mask
from attnlab.registry import UnknownNameError
from attnlab.scores import DotProductScore, Score, build_score, list_scores, register_score

__version__ = "0.1.0"

__all__ = [
    "AttentionOutput",
    "DotProductScore",
    "Encoder",
    "EncoderLayer",
    "LearnedPositionalEncoding",
    "Mask",
    "MultiHeadAttention",
    "PreparedMask",
    "Score",
    "SinusoidalPositionalEncoding",
    "UnknownNameError",
    "build_mask",
    "build_score",
    "list_masks",
    "list_scores",
    "prepare_mask",
    "register_mask",
    "register_score",
]
