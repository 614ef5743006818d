"""Convergence study: a tiny transformer LM trained with BF16 vs MXFP8 MLP backward passes.

    python simulations/mxfp8_convergence.py                      # CPU-sized default (~10-15 min on 2 cores)
    python simulations/mxfp8_convergence.py --large              # bigger model, more steps
    python simulations/mxfp8_convergence.py --steps 200 --configs bf16,neuron

Model: token embedding -> L pre-norm blocks (causal self-attention in fp32 torch, then a SwiGLU MLP,
``SwiGLUMLP(backend="emulate")``) -> final norm -> LM head. Parameters are fp32 (so the MLP weight
gradients leave the kernel's numerics as fp32 accumulators); the MLP forward is BF16. Only the MLP
backward changes between the runs:
    bf16       the kernel's BF16 path (matmul_precision="bf16": bf16 operands, fp32 accumulation)
    neuron     MXFP8 (e4m3fn by default), quantize_mx's scale rule (the hardware's)
    rceil      MXFP8 with the round-up scale rule of GPU stacks
    ocp_floor  MXFP8 with the OCP MX v1.0 example rule (elements saturate at the top of each group)
All runs use the same seeds (initial weights, data stream, evaluation batches). The `emulate`
backend reproduces the kernel's numerics bit for bit (tests/torch/test_emulate_numerics.py), so these
curves are what the kernel would train like, at torch speed.

Data (generated here, no downloads): a random order-2 Markov source over a small vocabulary
(sparse Dirichlet transition rows). Its conditional entropy is the best achievable loss; the script
reports it as the floor.

Outputs (--out, default simulations/out/convergence): results.json (config, loss curves, final-loss
gaps to bf16, gradient SQNR), loss_curves.png and grad_sqnr.png (matplotlib, optional: --no-plot).

Gradient SQNR (dB, 10 log10(|g_ref|^2 / |g - g_ref|^2)), on a fixed probe batch at every evaluation:
    local       per layer, for dX, dW_gate_up and dW_down: the layer's backward with the run's numerics
                vs an fp64 autograd backward at the same input x and the same output gradient dY;
    end_to_end  per layer, dW_gate_up and dW_down of the whole model's backward vs the same model
                with fp64 autograd MLPs (errors of later layers propagate into earlier ones).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import nkilib  # noqa: E402,F401
from nkilib.experimental.mlp_mxfp8 import SwiGLUMLP, swiglu_mlp_mxfp8  # noqa: E402

CONFIGS = {
    "bf16": dict(matmul_precision="bf16"),
    "neuron": dict(matmul_precision="mxfp8", scale_rule="neuron"),
    "rceil": dict(matmul_precision="mxfp8", scale_rule="rceil"),
    "ocp_floor": dict(matmul_precision="mxfp8", scale_rule="ocp_floor"),
}
LARGE = dict(d_model=256, d_ff=768, layers=4, heads=8, seq=128, batch=32, vocab=64, steps=5000)


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


class MarkovSource:
    """Order-2 Markov chain over `vocab` tokens with sparse Dirichlet(alpha) transition rows."""

    def __init__(self, vocab: int, seed: int, alpha: float = 0.05):
        r = np.random.default_rng(seed)
        self.vocab = vocab
        self.probs = r.dirichlet(np.full(vocab, alpha), size=(vocab, vocab))  # [prev2, prev1, next]
        self.cum = np.cumsum(self.probs, axis=-1)

    def sample(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        out = np.empty((batch, length), dtype=np.int64)
        out[:, :2] = rng.integers(0, self.vocab, (batch, 2))
        for t in range(2, length):
            c = self.cum[out[:, t - 2], out[:, t - 1]]
            out[:, t] = np.minimum((c < rng.random((batch, 1))).sum(axis=1), self.vocab - 1)
        return out

    def entropy_floor(self, rng: np.random.Generator, batch: int = 2000, length: int = 129) -> float:
        """Mean -log p(next | two previous) over a large sample (nats): the best achievable loss
        of a model that sees the two previous tokens (positions 0 and 1 have no context and are
        excluded, as they are uniformly random)."""
        seq = self.sample(rng, batch, length)
        p = self.probs[seq[:, :-2], seq[:, 1:-1], seq[:, 2:]]
        return float(-np.log(p).mean())


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------


def ideal_mlp(x, gate_up_weight, down_weight):
    """The SwiGLU MLP in fp64 autograd (the reference backward)."""
    n_i = down_weight.shape[1]
    x64, w64, d64 = x.double(), gate_up_weight.double(), down_weight.double()
    h = F.silu(x64 @ w64[:n_i].T) * (x64 @ w64[n_i:].T)
    return (h @ d64.T).to(x.dtype)


class Block(nn.Module):
    def __init__(self, d_model, d_ff, heads, mlp_options):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.mlp = SwiGLUMLP(d_model, d_ff, backend="emulate", **mlp_options)
        self.reference = False  # True: the MLP runs in fp64 autograd (the SQNR reference)
        self.capture = None  # dict to record the MLP input and output gradient

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        if self.capture is not None:
            self.capture["x"] = h.detach()
        y = ideal_mlp(h, self.mlp.gate_up_weight, self.mlp.down_weight) if self.reference else self.mlp(h)
        if self.capture is not None and y.requires_grad:
            y.register_hook(lambda g: self.capture.__setitem__("dy", g.detach()))
        return x + y


class TinyLM(nn.Module):
    def __init__(self, vocab, d_model, d_ff, layers, heads, seq, mlp_options):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        self.blocks = nn.ModuleList(Block(d_model, d_ff, heads, mlp_options) for _ in range(layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------------------
# gradient SQNR
# ---------------------------------------------------------------------------------------------


def sqnr_db(g, ref) -> float:
    err = float((g.double() - ref.double()).square().sum())
    sig = float(ref.double().square().sum())
    return float("inf") if err == 0 else 10.0 * math.log10(sig / err)


def gradient_sqnr(model, probe, mlp_options):
    """Per-layer local and end-to-end gradient SQNR of the run's MLP backward (module docstring)."""
    mlp_params = [(blk.mlp.gate_up_weight, blk.mlp.down_weight) for blk in model.blocks]
    for blk in model.blocks:
        blk.capture = {}
    model.zero_grad(set_to_none=True)
    lm_loss(model, probe).backward()
    run = [(gu.grad.clone(), dw.grad.clone()) for gu, dw in mlp_params]
    captured = [dict(blk.capture) for blk in model.blocks]
    for blk in model.blocks:
        blk.capture, blk.reference = None, True
    model.zero_grad(set_to_none=True)
    lm_loss(model, probe).backward()
    ref = [(gu.grad.clone(), dw.grad.clone()) for gu, dw in mlp_params]
    for blk in model.blocks:
        blk.reference = False
    model.zero_grad(set_to_none=True)
    out = []
    for layer, (blk, cap) in enumerate(zip(model.blocks, captured)):
        leaves = [t.detach().clone().requires_grad_() for t in (cap["x"], blk.mlp.gate_up_weight, blk.mlp.down_weight)]
        local = torch.autograd.grad(swiglu_mlp_mxfp8(*leaves, backend="emulate", **mlp_options), leaves, cap["dy"])
        leaves64 = [t.detach().double().requires_grad_() for t in leaves]
        local_ref = torch.autograd.grad(ideal_mlp(*leaves64), leaves64, cap["dy"].double())
        out.append({
            "layer": layer,
            "local": {n: sqnr_db(g, r) for n, g, r in zip(("dX", "dW_gate_up", "dW_down"), local, local_ref)},
            "end_to_end": {"dW_gate_up": sqnr_db(run[layer][0], ref[layer][0]),
                           "dW_down": sqnr_db(run[layer][1], ref[layer][1])},
        })
    return out


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train(name, args, source, val, probe):
    mlp_options = dict(CONFIGS[name], fp8_dtype=f"float8_{args.fp8}")
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.d_model, args.d_ff, args.layers, args.heads, args.seq, mlp_options)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    data_rng = np.random.default_rng(args.seed + 1)  # same stream for every config
    hist = {"step": [], "train_loss": [], "eval_step": [], "val_loss": [], "sqnr": []}
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        tokens = torch.from_numpy(source.sample(data_rng, args.batch, args.seq + 1))
        loss = lm_loss(model, tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        hist["step"].append(step)
        hist["train_loss"].append(float(loss.detach()))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with torch.no_grad():
                v = float(np.mean([float(lm_loss(model, vb)) for vb in val]))
            hist["eval_step"].append(step + 1)
            hist["val_loss"].append(v)
            hist["sqnr"].append(gradient_sqnr(model, probe, mlp_options))
            print(f"  [{name:>9}] step {step + 1:5d}  train {float(loss.detach()):.4f}  val {v:.4f}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    hist["wall_s"] = time.perf_counter() - t0
    return hist


def summarize(results, floor):
    """Final losses (mean of the last 10% of training losses, last validation loss), gaps to bf16,
    and SQNR averaged over the evaluations of the second half of training."""
    out = {}
    for name, h in results.items():
        n = max(1, len(h["train_loss"]) // 10)
        half = [s for st, s in zip(h["eval_step"], h["sqnr"]) if st > h["eval_step"][-1] / 2] or h["sqnr"][-1:]
        layers = []
        for layer in range(len(half[0])):
            entry = {"layer": layer}
            for kind in ("local", "end_to_end"):
                entry[kind] = {k: float(np.mean([ev[layer][kind][k] for ev in half]))
                               for k in half[0][layer][kind]}
            layers.append(entry)
        out[name] = {"final_train_loss": float(np.mean(h["train_loss"][-n:])), "final_val_loss": h["val_loss"][-1],
                     "sqnr_db": layers, "wall_s": h["wall_s"]}
    if "bf16" in out:
        for name, s in out.items():
            s["train_gap_vs_bf16"] = s["final_train_loss"] - out["bf16"]["final_train_loss"]
            s["val_gap_vs_bf16"] = s["final_val_loss"] - out["bf16"]["final_val_loss"]
    out["_loss_floor"] = floor
    return out


def plot(results, summary, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, h in results.items():
        tl = np.asarray(h["train_loss"])
        w = max(1, len(tl) // 50)
        smooth = np.convolve(tl, np.ones(w) / w, mode="valid")
        ax1.plot(np.arange(len(smooth)) + w, smooth, label=name)
        ax2.plot(h["eval_step"], h["val_loss"], marker=".", label=name)
    for ax, title in ((ax1, "training loss (moving average)"), (ax2, "validation loss")):
        ax.axhline(summary["_loss_floor"], color="k", ls=":", lw=1, label="entropy floor")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "loss_curves.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    names = list(results)
    layers = len(summary[names[0]]["sqnr_db"])
    keys = [("local", "dX"), ("local", "dW_gate_up"), ("local", "dW_down"), ("end_to_end", "dW_gate_up"),
            ("end_to_end", "dW_down")]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.6), sharey=True)
    for ax, (kind, k) in zip(axes, keys):
        for j, name in enumerate(names):
            vals = [summary[name]["sqnr_db"][layer][kind][k] for layer in range(layers)]
            ax.bar(np.arange(layers) + (j - len(names) / 2 + 0.5) * 0.8 / len(names), vals, 0.8 / len(names),
                   label=name)
        ax.set_title(f"{kind} {k}", fontsize=9)
        ax.set_xlabel("layer")
        ax.set_xticks(range(layers))
    axes[0].set_ylabel("gradient SQNR (dB)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "grad_sqnr.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _rounded(obj, digits=6):
    """Floats rounded to `digits` significant digits (keeps results.json small); other values as is."""
    if isinstance(obj, float):
        return obj if not math.isfinite(obj) or obj == 0 else float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v, digits) for v in obj]
    return obj


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--large", action="store_true", help=f"larger run: {LARGE} (explicit flags still override)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 2000; --large 5000)")
    p.add_argument("--d-model", type=int, default=None, help="H (multiple of 32; default 128)")
    p.add_argument("--d-ff", type=int, default=None, help="I (multiple of 32; default 256)")
    p.add_argument("--layers", type=int, default=None, help="default 2")
    p.add_argument("--heads", type=int, default=None, help="default 4")
    p.add_argument("--seq", type=int, default=None, help="default 64")
    p.add_argument("--batch", type=int, default=None, help="default 16")
    p.add_argument("--vocab", type=int, default=None, help="default 32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=None, help="default 5%% of the steps")
    p.add_argument("--eval-every", type=int, default=None, help="default steps / 20")
    p.add_argument("--fp8", default="e4m3fn", choices=("e4m3fn", "e5m2"))
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: the matmuls are small, and OpenMP spin-waiting on a "
                        "busy machine made 2 threads 20x slower than 1 in our measurements)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "convergence"))
    p.add_argument("--no-plot", action="store_true", help="skip the PNGs (no matplotlib needed)")
    args = p.parse_args(argv)
    small = dict(d_model=128, d_ff=256, layers=2, heads=4, seq=64, batch=16, vocab=32, steps=2000)
    for k, v in (LARGE if args.large else small).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    args.eval_every = args.eval_every if args.eval_every is not None else max(1, args.steps // 20)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or not names:
        p.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    args.config_names = names
    if args.d_model % args.heads:
        p.error("--d-model must be a multiple of --heads")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    source = MarkovSource(args.vocab, args.seed)
    eval_rng = np.random.default_rng(args.seed + 2)
    val = [torch.from_numpy(source.sample(eval_rng, args.batch, args.seq + 1)) for _ in range(4)]
    probe = torch.from_numpy(source.sample(eval_rng, args.batch, args.seq + 1))
    floor = source.entropy_floor(np.random.default_rng(args.seed + 3))
    print(f"tiny LM: vocab {args.vocab}, H={args.d_model}, I={args.d_ff}, {args.layers} layers, seq {args.seq}, "
          f"batch {args.batch} (S = {args.batch * args.seq} tokens per MLP call), {args.steps} steps, "
          f"fp8 {args.fp8}; entropy floor {floor:.4f} nats", flush=True)
    results = {name: train(name, args, source, val, probe) for name in args.config_names}
    summary = summarize(results, floor)
    header = (f"{'config':<10}{'train':>9}{'val':>9}{'gap(train)':>12}{'gap(val)':>10}"
              "   local SQNR dB per layer (dX/dWgu/dWd)")
    print("\n" + header + "\n" + "-" * len(header))
    for name in args.config_names:
        s = summary[name]
        sq = "  ".join("/".join(f"{v:.1f}" for v in layer["local"].values()) for layer in s["sqnr_db"])
        print(f"{name:<10}{s['final_train_loss']:9.4f}{s['final_val_loss']:9.4f}"
              f"{s.get('train_gap_vs_bf16', float('nan')):12.4f}{s.get('val_gap_vs_bf16', float('nan')):10.4f}   {sq}")
    paths = [] if args.no_plot else plot(results, summary, args.out)
    payload = {"args": {k: v for k, v in vars(args).items() if k != "config_names"},
               "configs": {n: CONFIGS[n] for n in args.config_names}, "summary": summary, "history": results,
               "plots": paths}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(_rounded(payload), f, default=float)
    print(f"\nwrote {os.path.join(args.out, 'results.json')}" + "".join(f", {p}" for p in paths))
    return payload


if __name__ == "__main__":
    main()
