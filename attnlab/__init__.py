"""attnlab: a lab bench for comparing attention mechanisms.

The public API: the registries of scores, position biases, masks and normalizers (three verbs each: register,
build, list), multi-head attention with a free per-head key size and pluggable stages, and the encoder.
"""

from attnlab.attention import AttentionOutput, MultiHeadAttention
from attnlab.encoder import (
    Encoder,
    EncoderLayer,
    LearnedPositionalEncoding,
    SinusoidalPositionalEncoding,
)
from attnlab.masks import Mask, PreparedMask, build_mask, list_masks, prepare_mask, register_mask
from attnlab.normalizers import Normalizer, build_normalizer, list_normalizers, register_normalizer
from attnlab.positions import RotaryEmbedding
from attnlab.registry import UnknownNameError
from attnlab.scores import (
    DotProductScore,
    PositionBias,
    Score,
    build_position_bias,
    build_score,
    list_position_biases,
    list_scores,
    register_position_bias,
    register_score,
)
from attnlab.tasks import build_task, list_tasks, register_task

__version__ = "0.2.0"

__all__ = [
    "AttentionOutput",
    "DotProductScore",
    "Encoder",
    "EncoderLayer",
    "LearnedPositionalEncoding",
    "Mask",
    "MultiHeadAttention",
    "Normalizer",
    "PositionBias",
    "PreparedMask",
    "RotaryEmbedding",
    "Score",
    "SinusoidalPositionalEncoding",
    "UnknownNameError",
    "build_mask",
    "build_normalizer",
    "build_position_bias",
    "build_score",
    "build_task",
    "list_masks",
    "list_normalizers",
    "list_position_biases",
    "list_scores",
    "list_tasks",
    "prepare_mask",
    "register_mask",
    "register_normalizer",
    "register_position_bias",
    "register_score",
    "register_task",
]
