"""attnlab: a lab bench for comparing attention mechanisms.

The public API: one description of a layer's attention (:class:`AttentionConfig`, its presets and per-layer
patterns), the registries of scores, position biases, masks, normalizers, linear attention's feature maps and
backends (three verbs each: register, build, list), multi-head attention with a free per-head key size and
pluggable stages, and the encoder.
"""

from attnlab.attention import AttentionOutput, MultiHeadAttention
from attnlab.backends import Backend, build_backend, list_backends, register_backend
from attnlab.config import AttentionConfig, build_preset, layer_configs
from attnlab.encoder import (
    Encoder,
    EncoderLayer,
    LearnedPositionalEncoding,
    SinusoidalPositionalEncoding,
)
from attnlab.feature_maps import FeatureMap, build_feature_map, list_feature_maps, register_feature_map
from attnlab.masks import Mask, PreparedMask, build_mask, list_masks, prepare_mask, register_mask
from attnlab.normalizers import Normalizer, build_normalizer, list_normalizers, register_normalizer
from attnlab.position_bias import PositionBias, build_position_bias, list_position_biases, register_position_bias
from attnlab.positions import RotaryEmbedding
from attnlab.registry import UnknownNameError
from attnlab.scores import (
    DotProductScore,
    Score,
    build_score,
    list_presets,
    list_scores,
    register_preset,
    register_score,
)
from attnlab.tasks import build_task, list_tasks, register_task

__version__ = "0.6.0"

__all__ = [
    "AttentionConfig",
    "AttentionOutput",
    "Backend",
    "DotProductScore",
    "Encoder",
    "EncoderLayer",
    "FeatureMap",
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
    "build_backend",
    "build_feature_map",
    "build_mask",
    "build_normalizer",
    "build_position_bias",
    "build_preset",
    "build_score",
    "build_task",
    "layer_configs",
    "list_backends",
    "list_feature_maps",
    "list_masks",
    "list_normalizers",
    "list_position_biases",
    "list_presets",
    "list_scores",
    "list_tasks",
    "prepare_mask",
    "register_backend",
    "register_feature_map",
    "register_mask",
    "register_normalizer",
    "register_position_bias",
    "register_preset",
    "register_score",
    "register_task",
]
