"""Why does a bidirectional encoder stay at chance on MQAR's interleaved layout while a causal one solves it?

Two pieces of evidence, printed as tables (``python experiments/mqar/bidirectional.py [RUN ...]``):

1. **A hand-built bidirectional solution.** Two attention layers of :class:`attnlab.attention.MultiHeadAttention`
   (scaled dot product, one head each, **no mask**) with weights set by hand solve attnlab's own MQAR validation set
   (100 %). So the data, the labels and the unmasked attention path are right, and bidirectional attention can
   represent the task: the failure is one of optimisation, not of capacity or of attnlab.

   The residual stream is ``[token one-hot | position one-hot | previous key | value read]``:

   * layer 1 (a *previous-token head*): the query of position ``i`` is the one-hot of ``i - 1``, the key of ``j`` the
     one-hot of ``j``; the value copies the key part of the token one-hot into "previous key". Every position now
     holds the key just before it; a value token ``v_m`` holds its key ``k_m``.
   * layer 2 (the *lookup*): the query of a position is its own key one-hot, the key of ``j`` its "previous key";
     the value is the value one-hot of the token. A query for key ``k`` attends to ``v_m`` with ``k_m = k`` (and, at
     most, to the query right after it in the query region, whose value part is zero) and reads ``v_m``.

   Nothing in it looks at the future: the same weights solve the task under a causal mask too.

2. **What trained models do** (given run folders: a causal and a bidirectional run of the same config). For each
   layer and head, on validation sequences, the mean attention weight that

   * a context *value* position gives the key right before it (``prev``; the previous-token head of the
     induction circuit), and the key right after it (``next``);
   * a *query* position gives the value of its key in the context (``value``) and that key itself (``key``);
   * a query position gives itself (``self``).

   A causal model that solved the task shows ``prev`` near 1 in one layer-1 head and ``value`` near 1 in a layer-2
   head; the bidirectional one shows neither. Each run's validation accuracy is printed with its own mask and with
   the mask taken away (``acc no mask``): whether a causal model's solution survives without the mask.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.attention import MultiHeadAttention
from attnlab.masks import build_mask
from attnlab.tasks import IGNORE_INDEX, AssociativeRecall


class HandBuiltMQAR(nn.Module):
    """The two-layer bidirectional MQAR solution described in the module docstring.

    Args:
        task: the MQAR task whose token ids and length it is built for.
        sharpness: logit gap of a matching over a non-matching key (before softmax), e.g. 30.
    """

    def __init__(self, task: AssociativeRecall, sharpness: float = 30.0) -> None:
        super().__init__()
        V, L, K, C = task.vocab_size, task.max_len, task.vocab_keys, task.vocab_values
        self.tok, self.pos, self.prev, self.out = 0, V, V + L, V + L + K  # offsets of the four parts
        D = V + L + K + C
        self.task, self.length = task, L
        self.attn1 = MultiHeadAttention(D, 1, d_k=L, d_v=K, score="scaled_dot", bias=False).double()
        self.attn2 = MultiHeadAttention(D, 1, d_k=K, d_v=C, score="scaled_dot", bias=False).double()
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()
            a1, a2 = self.attn1, self.attn2
            beta1 = sharpness * math.sqrt(L)  # scaled_dot divides by sqrt(d_k)
            for i in range(1, L):
                a1.q_proj.weight[i - 1, self.pos + i] = beta1  # query of position i: "position i - 1"
            for j in range(L):
                a1.k_proj.weight[j, self.pos + j] = 1.0  # key of position j: "position j"
            for k in range(K):
                a1.v_proj.weight[k, self.tok + task.key_offset + k] = 1.0  # value: the key one-hot
                a1.out_proj.weight[self.prev + k, k] = 1.0  # written to "previous key"
            beta2 = sharpness * math.sqrt(K)
            for k in range(K):
                a2.q_proj.weight[k, self.tok + task.key_offset + k] = beta2  # query: my own key
                a2.k_proj.weight[k, self.prev + k] = 1.0  # key: the key before me
            for c in range(C):
                a2.v_proj.weight[c, self.tok + task.value_offset + c] = 1.0  # value: my value class
                a2.out_proj.weight[self.out + c, c] = 1.0

    def forward(self, tokens: Tensor, mask: str | None = None) -> Tensor:
        """tokens (B, L) → value-class logits (B, L, C); ``mask`` None (bidirectional) or ``"causal"``."""
        B, L = tokens.shape
        allowed = None if mask is None else torch.ones(L, L, dtype=torch.bool).tril()  # causal: j <= i
        x = torch.zeros(B, L, self.attn1.q_proj.in_features, dtype=torch.float64)
        x.scatter_(2, (self.tok + tokens).unsqueeze(-1), 1.0)
        x[:, torch.arange(L), self.pos + torch.arange(L)] = 1.0
        x = x + self.attn1(x, mask=allowed)[0]
        x = x + self.attn2(x, mask=allowed)[0]
        return x[..., self.out :]


def accuracy(logits: Tensor, labels: Tensor) -> float:
    keep = labels != IGNORE_INDEX
    return float((logits.argmax(-1)[keep] == labels[keep]).double().mean())


def hand_built(num_pairs: int = 8, vocab: int = 32, seed: int = 0) -> None:
    task = AssociativeRecall(num_pairs=num_pairs, vocab_keys=vocab, vocab_values=vocab, seed=seed, batch_size=1)
    tokens, labels = task.tensors("val")
    model = HandBuiltMQAR(task)
    print(f"hand-built 2-layer attention, {task.describe()}")
    for mask in (None, "causal"):
        with torch.no_grad():
            acc = accuracy(model(tokens, mask), labels)
        print(f"  mask={mask or 'none':<7} val accuracy {acc:.2%} on {int((labels != IGNORE_INDEX).sum())} queries")


def reading(run_dirs: list[str], num: int = 256) -> None:
    from omegaconf import OmegaConf

    from attnlab.module import EncoderModule
    from attnlab.runs import load_yaml_untrusted

    accuracies: list[tuple[str, float, float]] = []
    print("\nattention of trained models (mean weight; see the module docstring)")
    columns = ("prev", "next", "value", "key", "self")
    print(f"{'run':<28} {'mask':<7} {'layer':>5} {'head':>4} " + " ".join(f"{c:>6}" for c in columns))
    for run in run_dirs:
        folder = Path(run)
        cfg = OmegaConf.create(load_yaml_untrusted(folder / "config.yaml"))  # a run folder is data
        params = OmegaConf.to_container(cfg.task.datamodule, resolve=True)
        params.pop("_target_")
        params.pop("test_lengths", None)
        task = AssociativeRecall(**params)
        tokens, _ = task.tensors("val")
        tokens = tokens[:num]
        module = EncoderModule.load_from_checkpoint(folder / "checkpoints" / "last.ckpt", map_location="cpu")
        module.eval()
        all_tokens, all_labels = task.tensors("val")
        with torch.no_grad():
            _, records = module.encoder(tokens, need_weights=True)
            own = accuracy(module(all_tokens), all_labels)
            module.encoder._structural = build_mask("none")
            unmasked = accuracy(module(all_tokens), all_labels)
        accuracies.append((folder.name, own, unmasked))
        n, c = task.num_pairs, task.context_len
        rows = torch.arange(tokens.shape[0])
        for layer, record in enumerate(records, start=1):
            w = record.weights.double()  # (B, H, L, L)
            for h in range(w.shape[1]):
                wh = w[:, h]
                values = torch.arange(1, 2 * n, 2)
                prev = wh[:, values, values - 1].mean()
                nxt = wh[:, values[:-1], values[:-1] + 1].mean()
                got_v, got_k, diag = [], [], []
                for b in rows:
                    keys = tokens[b, 0:c:2]
                    for i in torch.nonzero(tokens[b, c:] != task.filler_id).squeeze(-1) + c:
                        m = int(torch.nonzero(keys == tokens[b, i]).squeeze())
                        got_v.append(wh[b, i, 2 * m + 1])
                        got_k.append(wh[b, i, 2 * m])
                        diag.append(wh[b, i, i])
                mask = str(cfg.mask.get("name", cfg.mask)) if cfg.get("mask") else "none"
                print(
                    f"{folder.name:<28} {mask:<7} {layer:>5} {h:>4} {prev:6.3f} {nxt:6.3f} "
                    f"{torch.stack(got_v).mean():6.3f} {torch.stack(got_k).mean():6.3f} {torch.stack(diag).mean():6.3f}"
                )
    print(f"\n{'run':<28} {'val acc':>8} {'acc no mask':>12}")
    for name, own, unmasked in accuracies:
        print(f"{name:<28} {own:8.2%} {unmasked:12.2%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="run folders of MQAR runs to read (causal and bidirectional)")
    args = parser.parse_args(argv)
    hand_built()
    if args.runs:
        reading(args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
