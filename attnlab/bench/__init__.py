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
  the resting parameters and optimizer state) and the SDPA kernel that ran, and one counted step for the FLOPs
  (the roofline column, below).
* ``mha``: the attention module alone, attnlab ``MultiHeadAttention`` against ``nn.MultiheadAttention``.
* ``variants``: the same encoder training step (same shapes: 4096 tokens per batch, d_model 128, 2 layers, H = 4,
  d_k = 32) with each attention stage of :data:`ATTENTION_VARIANTS` switched on in turn (rotary positions, QK-norm,
  grouped/multi-query heads, cosine score, differential attention (``diff``: H heads of two maps; ``diff_paired``:
  Ye et al.'s H/2 heads with values of 2·d_k), soft-capping, ALiBi, Shaw and T5 position biases, every eager
  normalizer), against attnlab's plain ``scaled_dot`` timed in the same interleaved rounds, at
  L ∈ {128, 512, 1024}; each marked with whether it takes the SDPA fast path
  (``MultiHeadAttention.uses_fast_path``) and with the backend its first layer's training step runs
  (``backend_for(device, dtype)``: ``sdpa``, ``tiled``, ``eager``, ...). Goals at L = 512: issue 7's (rotary,
  QK-norm, grouped heads ≤ 1.10) and issue 31's (31b–e: entmax15 ≤ 2.0, differential ≤ 1.3, sparsemax and
  softpick ≤ 1.5); issue 48's at L 512 and 1024 (48a: ALiBi, T5, Shaw, rope + T5, soft-capping, softmax1, sink,
  sigmoid ≤ 1.15, replacing issue 8's 2.5 and 31a's 1.3; 48b: differential ≤ 1.3 at L 1024 too; 48c: every softmax
  variant's roofline fraction at least 45 % at L 512; 48d: its peak memory ≤ 1.2× scaled_dot's at L 1024).
* ``blocks``: bare stacks of attnlab encoder layers (forward + backward, no optimizer): the relative-position and
  T5 kernels against scaled_dot, the additive kernels against the naive (B, H, L, L, d_a) form.
* ``tiled``: attnlab's tiled kernel alone (:mod:`attnlab.kernels.tiled`), forward + backward of one call with a T5
  table and causal, its block products through PyTorch's BLAS and through its own loops (the fully fused form),
  against SDPA's flash kernel on the same tensors; reported, no goal.
* ``linear``: causal training steps of linear attention and the decay/delta-rule forms, each at its defaults and
  at each of its named settings (from the registry: retnet, gla, gla_channel, gla_mamba2, deltanet,
  deltanet_beta2, gated_deltanet, gated_deltanet_beta2, kda, kda_beta2, deltaproduct, deltaproduct_beta2, rwkv7;
  the ``chunked`` backend) against causal softmax (SDPA) at L from 256 to 4096, 4096 tokens per batch. Goals at
  L 4096: issue 27's for linear attention, issue 31's (31f: retnet, gla, deltanet, gated_deltanet ≤ 1.0×), issue
  42's (42a: gla_channel ≤ 1.5×, 42b: kda ≤ 1.5×, 42c: gla_mamba2 ≤ 1.0×; 42d: each β ∈ (0, 2) row ≤ 1.05× its
  β ∈ (0, 1) row, the run-to-run noise), issue 43's (43a: deltaproduct, n = 2, ≤ 2.0×; 43b: rwkv7 ≤ 2.0×).
* ``decode``: one token at a time with a key/value cache against the recurrent rows' state: each ≤ 1/3 of
  softmax's time per token at the longest context (42e for issue 42's rows, 43c for issue 43's, 28a for the
  others; 28b: a constant state).
* ``diagnostics``: real Lightning training of the default config (``attnlab.training.run``, logger none) with the
  attention diagnostics callback on and off, interleaved, whole-run wall times.
* ``additive_memory``: peak memory of the additive score's forward + backward against the naive form that
  materialises (B, H, L, L, d_a), each in a fresh subprocess (peak RSS: VmHWM reset before the measurement, or
  ``ru_maxrss``), and the largest difference between their results.
* ``default_run``: wall time of the default ``python train.py`` (a subprocess; skipped with ``--quick``).
* ``fused``: SDPA restricted to the fused kernels (flash, memory-efficient) must accept ``scaled_dot``.
* ``flex`` (:mod:`attnlab.bench.flex`): one attention layer through the ``flex`` backend (compiled FlexAttention)
  against the materialised ``eager`` path (and ``sdpa`` where it applies) for ALiBi, T5, Shaw, soft-capping and a
  causal window: training steps on CUDA at L 1024 and 4096; on the CPU, where FlexAttention is forward-only, the
  forward alone at L 256, labelled so. A run without ``--only`` includes it on CUDA only (on the CPU each
  configuration's compile takes 10–45 s): ``--only flex`` runs it on the CPU.

The roofline column (``% peak`` in the encoder, variants, blocks and linear tables; ``flops``,
``achieved_flops_s`` and ``roofline`` in their rows): before the timed sections the run measures the machine's
practical peak, the median FLOP/s of a few large square ``torch.mm`` (2048², float32; in the run's dtype with
``--dtype bf16``/``fp16``) → ``results["peak"]``. Each model's training step is counted once, after its timings,
with :mod:`attnlab.compute`'s counter (``FlopCounterMode``: forward + backward, the optimizer free) → ``flops``;
``achieved_flops_s`` = flops ÷ median step; ``roofline`` = achieved ÷ peak. The count is of **matrix products
only** (2 FLOPs per multiply-add; softmax, normalisation and elementwise work are free, and causal softmax counts
the masked half too, as torch's SDPA formula does), so the fraction says how much of the machine's matrix-product
rate a step turns into matrix-product work: a report, with no goal.

Writes ``bench.json`` (everything, with the machine: platform, CPU model, cores, torch version, threads, date; and
the peak),
``bench.csv`` (one row per measured model) and ``targets.csv`` (each target's ratio, limit, met) into ``--out``
(default: a new folder ``bench_results/<date-time>/``, with ``bench_results/latest`` pointing at it), and prints
the tables. Targets are checked here, never by a timed test; a ``--quick`` run is labelled as such and never
judged against them.

Modules: ``cases`` (variants, goals, shapes, models, plans), ``harness`` (training-step closures, interleaved
timing, profiled peak memory and SDPA kernel, the FLOP count of a step, the peak FLOP/s, peak RSS), ``sections``
(one function per section), ``report`` (machine, targets, roofline, tables, results folder), ``cli``.
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
from attnlab.bench.harness import count_step_flops, interleaved_times, make_train_step, measure_peak, profile_step
from attnlab.bench.report import (
    CSV_FIELDS,
    QUICK_NOTE,
    RESULTS_ROOT,
    ROOFLINE_SECTIONS,
    TARGET_FIELDS,
    add_roofline,
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
    "ROOFLINE_SECTIONS",
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
    "add_roofline",
    "bench_additive_memory",
    "bench_blocks",
    "bench_default_run",
    "bench_diagnostics",
    "bench_encoder",
    "bench_mha",
    "bench_variants",
    "build_model",
    "check_fused_sdpa",
    "count_step_flops",
    "evaluate_targets",
    "format_tables",
    "format_variants",
    "full_plan",
    "interleaved_times",
    "machine_info",
    "main",
    "make_train_step",
    "measure_peak",
    "naive_additive_logits",
    "new_results_dir",
    "parse_args",
    "profile_step",
    "quick_plan",
    "run_bench",
    "write_results",
]
