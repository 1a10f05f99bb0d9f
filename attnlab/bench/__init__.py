"""Benchmark harness: attnlab against PyTorch's own attention, measured side by side in one process.

    python -m attnlab.bench                   # the full benchmark (minutes; run it on an otherwise idle machine)
    python -m attnlab.bench --quick           # a tiny smoke run (seconds)
    python -m attnlab.bench --device cuda --dtype bf16

Sections (each a function of :mod:`attnlab.bench.sections`; ``--only`` picks some):

* ``encoder``: one training step (forward + backward + AdamW step) of a 2-layer encoder + linear head with a
  per-token cross-entropy loss, for every attention variant and for ``torch.nn.TransformerEncoder`` at identical
  shapes (pre-LN, GELU, d_ff = 4·d_model, no dropout, same embedding, sinusoidal encoding and final norm), over
  L ∈ {128, 512, 1024} at 4096 tokens per batch, and several (heads, d_k). Warm-up, then interleaved
  repetitions (A B C … A B C …), medians; then one profiled step per model for the peak memory (allocations above
  the resting parameters and optimizer state) and the SDPA kernel that ran.
* ``mha``: the attention module alone, attnlab ``MultiHeadAttention`` against ``nn.MultiheadAttention``.
* ``variants``: the same encoder training step (same shapes: 4096 tokens per batch, d_model 128, 2 layers, H = 4,
  d_k = 32) with each attention stage of :data:`ATTENTION_VARIANTS` switched on in turn (rotary positions, QK-norm,
  grouped/multi-query heads, cosine score, differential attention, soft-capping, ALiBi as a position bias, every
  eager normalizer), against attnlab's plain ``scaled_dot`` timed in the same interleaved rounds, at
  L ∈ {128, 512, 1024}; each marked with whether it takes the SDPA fast path
  (``MultiHeadAttention.uses_fast_path``).
* ``diagnostics``: real Lightning training of the default config (``attnlab.train.run``, logger none) with the
  attention diagnostics callback on and off, interleaved, whole-run wall times.
* ``additive_memory``: peak memory of the additive score's forward + backward against the naive form that
  materialises (B, H, L, L, d_a), each in a fresh subprocess (peak RSS: VmHWM reset before the measurement, or
  ``ru_maxrss``), and the largest difference between their results.
* ``default_run``: wall time of the default ``python train.py`` (a subprocess; skipped with ``--quick``).
* ``fused``: SDPA restricted to the fused kernels (flash, memory-efficient) must accept ``scaled_dot``.

Writes ``bench.json`` (everything, with the machine: platform, CPU model, cores, torch version, threads, date),
``bench.csv`` (one row per measured model) and ``targets.csv`` (each target's ratio, limit, met) into ``--out``
(default: a new folder ``bench_results/<date-time>/``, with ``bench_results/latest`` pointing at it), and prints
the tables. Targets are checked here, never by a timed test; a ``--quick`` run is labelled as such and never
judged against them.

Modules: ``cases`` (variants, goals, shapes, models, plans), ``harness`` (training-step closures, interleaved
timing, profiled peak memory and SDPA kernel, peak RSS), ``sections`` (one function per section), ``report``
(machine, targets, tables, results folder), ``cli``.
"""

from attnlab.bench.cases import (
    ATTENTION_VARIANTS,
    NUM_CLASSES,
    VARIANT_GOALS,
    VARIANTS,
    VOCAB_SIZE,
    Group,
    ModelSpec,
    Plan,
    Shape,
    TorchEncoder,
    build_model,
    full_plan,
    quick_plan,
)
from attnlab.bench.cli import DTYPES, SECTIONS, Options, main, parse_args, run_bench
from attnlab.bench.harness import interleaved_times, make_train_step, profile_step
from attnlab.bench.report import (
    CSV_FIELDS,
    QUICK_NOTE,
    RESULTS_ROOT,
    TARGET_FIELDS,
    evaluate_targets,
    format_tables,
    format_variants,
    machine_info,
    new_results_dir,
    write_results,
)
from attnlab.bench.sections import (
    REPO_ROOT,
    FusedKernelUnavailable,
    bench_additive_memory,
    bench_blocks,
    bench_default_run,
    bench_diagnostics,
    bench_encoder,
    bench_mha,
    bench_variants,
    check_fused_sdpa,
    naive_additive_logits,
)

__all__ = [
    "ATTENTION_VARIANTS",
    "CSV_FIELDS",
    "DTYPES",
    "NUM_CLASSES",
    "QUICK_NOTE",
    "REPO_ROOT",
    "RESULTS_ROOT",
    "SECTIONS",
    "TARGET_FIELDS",
    "VARIANTS",
    "VARIANT_GOALS",
    "VOCAB_SIZE",
    "FusedKernelUnavailable",
    "Group",
    "ModelSpec",
    "Options",
    "Plan",
    "Shape",
    "TorchEncoder",
    "bench_additive_memory",
    "bench_blocks",
    "bench_default_run",
    "bench_diagnostics",
    "bench_encoder",
    "bench_mha",
    "bench_variants",
    "build_model",
    "check_fused_sdpa",
    "evaluate_targets",
    "format_tables",
    "format_variants",
    "full_plan",
    "interleaved_times",
    "machine_info",
    "main",
    "make_train_step",
    "naive_additive_logits",
    "new_results_dir",
    "parse_args",
    "profile_step",
    "quick_plan",
    "run_bench",
    "write_results",
]
