"""Convergence study: tiny byte-level LMs (dense or MoE) trained on real text with BF16 vs MXFP8 backward passes.

    python simulations/mxfp8_convergence.py                 # dense MLPs, 4 backward configs (CPU default)
    python simulations/mxfp8_convergence.py --moe           # MoE model, BF16 vs MXFP8 (CPU default)
    python simulations/mxfp8_convergence.py --moe --device cuda --large
    python simulations/mxfp8_convergence.py --steps 200 --configs bf16,neuron

Data: the Python standard library's own top-level sources, read as bytes (simulations/stdlib_corpus.py:
deterministic file selection, every tenth file by name held out), vocabulary the 256 byte values. No
downloads, nothing generated. The texts depend on the Python version; results.json records it with the
sizes and SHA-256 of both splits.

Models (simulations/convergence_model.py): attention + FFN blocks; the FFNs are our ops with the
``emulate`` backend (bit-identical to the kernels' numerics, tests/torch/test_emulate_numerics.py and
test_torch_moe.py), so these curves are what the kernels would train like, at torch speed:
    dense (default)  every FFN ``SwiGLUMLP`` (swiglu_mlp_mxfp8);
    --moe            the first --dense-layers FFNs ``SwiGLUMLP``, the others a softmax top-k router and
                     ``MoESwiGLUExperts`` (moe_swiglu_experts_mxfp8), plus a load-balancing loss.
Parameters are fp32, forwards BF16; only the FFN backward changes between the runs:
    bf16       the kernels' BF16 path (matmul_precision="bf16": bf16 operands, fp32 accumulation)
    neuron     MXFP8 (e4m3fn by default), quantize_mx's scale rule (the hardware's)
    rceil      MXFP8 with the round-up scale rule of GPU stacks
    ocp_floor  MXFP8 with the OCP MX v1.0 example rule (elements saturate at the top of each group)
All runs use the same seeds (initial weights, training windows, held-out windows, probe batch).

Outputs (--out, default simulations/out/convergence[_moe]): results.json (arguments, corpus, loss curves,
final-loss gaps to bf16, gradient SQNR per layer), loss_curves.png and grad_sqnr.png (--no-plot skips
them). Gradient SQNR: see convergence_model.py (local: each layer vs fp64 autograd at the same input and
output gradient; end_to_end: the whole model's FFN gradients vs the same model with fp64 FFNs).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, _HERE)

import torch  # noqa: E402

import nkilib  # noqa: E402,F401
from convergence_model import TinyLM, gradient_sqnr, lm_loss  # noqa: E402
from stdlib_corpus import VOCAB, load_stdlib_corpus  # noqa: E402

CONFIGS = {
    "bf16": dict(matmul_precision="bf16"),
    "neuron": dict(matmul_precision="mxfp8", scale_rule="neuron"),
    "rceil": dict(matmul_precision="mxfp8", scale_rule="rceil"),
    "ocp_floor": dict(matmul_precision="mxfp8", scale_rule="ocp_floor"),
}
# CPU defaults, sized for <= 15 min on a 2-core machine (one torch thread per run; README "Convergence study"
# gives the measured time); --large for a GPU
DENSE = dict(d_model=128, d_ff=256, layers=2, heads=4, seq=64, batch=16, steps=800,
             configs="bf16,neuron,rceil,ocp_floor")
MOE = dict(d_model=128, d_ff=256, layers=2, heads=4, seq=64, batch=16, steps=700, experts=8, top_k=2, d_expert=64,
           dense_layers=1, configs="bf16,neuron")
LARGE = dict(d_model=256, d_ff=768, layers=4, heads=8, seq=128, batch=32, steps=5000, d_expert=256, experts=16)
VAL_BATCHES = 8


def _progress(iterable, desc, total):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional ([sim] extra)
        return iterable, print
    bar = tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)
    return bar, bar.write


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _moe_spec(args):
    if not args.moe:
        return None
    return dict(experts=args.experts, top_k=args.top_k, d_expert=args.d_expert, dense_layers=args.dense_layers)


def train(name, args, corpus, val, probe, device):
    options = dict(CONFIGS[name], fp8_dtype=f"float8_{args.fp8}")
    torch.manual_seed(args.seed)
    model = TinyLM(VOCAB, args.d_model, args.d_ff, args.layers, args.heads, args.seq, options,
                   moe=_moe_spec(args)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    data_rng = np.random.default_rng(args.seed + 1)  # same training windows for every config
    hist = {"step": [], "train_loss": [], "eval_step": [], "val_loss": [], "sqnr": []}
    t0 = time.perf_counter()
    steps, write = _progress(range(args.steps), name, args.steps)
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        tokens = torch.from_numpy(corpus.batch(data_rng, "train", args.batch, args.seq + 1)).to(device)
        loss = lm_loss(model, tokens)
        aux = model.aux_loss()
        total = loss if aux is None else loss + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        hist["step"].append(step)
        hist["train_loss"].append(float(loss.detach()))
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{hist['train_loss'][-1]:.3f}", refresh=False)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with torch.no_grad():
                v = float(np.mean([float(lm_loss(model, vb)) for vb in val]))
            hist["eval_step"].append(step + 1)
            hist["val_loss"].append(v)
            hist["sqnr"].append(gradient_sqnr(model, probe))
            write(f"  [{name:>9}] step {step + 1:5d}  train {hist['train_loss'][-1]:.4f}  held-out {v:.4f}  "
                  f"({time.perf_counter() - t0:.0f} s)")
    hist["wall_s"] = time.perf_counter() - t0
    return hist


def summarize(results, baseline):
    """Final losses (mean of the last 10% of training losses, last held-out loss), gaps to bf16, and SQNR
    averaged over the evaluations of the second half of training."""
    out = {}
    for name, h in results.items():
        n = max(1, len(h["train_loss"]) // 10)
        half = [s for st, s in zip(h["eval_step"], h["sqnr"]) if st > h["eval_step"][-1] / 2] or h["sqnr"][-1:]
        layers = []
        for layer in range(len(half[0])):
            entry = {"layer": layer, "kind": half[0][layer]["kind"]}
            for kind in ("local", "end_to_end"):
                entry[kind] = {k: float(np.mean([ev[layer][kind][k] for ev in half])) for k in half[0][layer][kind]}
            layers.append(entry)
        out[name] = {"final_train_loss": float(np.mean(h["train_loss"][-n:])), "final_val_loss": h["val_loss"][-1],
                     "sqnr_db": layers, "wall_s": h["wall_s"]}
    if "bf16" in out:
        for name, s in out.items():
            s["train_gap_vs_bf16"] = s["final_train_loss"] - out["bf16"]["final_train_loss"]
            s["val_gap_vs_bf16"] = s["final_val_loss"] - out["bf16"]["final_val_loss"]
    out["_unigram_entropy"] = baseline
    return out


def plot(results, summary, out_dir, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.5))
    for name, h in results.items():
        tl = np.asarray(h["train_loss"])
        w = max(1, len(tl) // 50)
        smooth = np.convolve(tl, np.ones(w) / w, mode="valid")
        ax1.plot(np.arange(len(smooth)) + w, smooth, label=name)
        ax2.plot(h["eval_step"], h["val_loss"], marker=".", label=name)
        if "bf16" in results:
            ax3.plot(h["eval_step"], np.asarray(h["val_loss"]) - np.asarray(results["bf16"]["val_loss"]), marker=".",
                     label=name)
    ax3.set_xlabel("step")
    ax3.set_ylabel("held-out loss minus bf16's (nats / byte)")
    ax3.set_title(f"{title}: gap to the BF16 backward", fontsize=10)
    ax3.legend(fontsize=8)
    for ax, sub in ((ax1, "training loss (moving average)"), (ax2, "held-out loss")):
        ax.axhline(summary["_unigram_entropy"], color="k", ls=":", lw=1, label="unigram entropy")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats / byte)")
        ax.set_title(f"{title}: {sub}", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "loss_curves.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    names = [n for n in results]
    layers = summary[names[0]]["sqnr_db"]
    fig, axes = plt.subplots(1, len(layers), figsize=(5.2 * len(layers), 3.8), sharey=True, squeeze=False)
    for ax, layer in zip(axes[0], layers):
        keys = [(kind, k) for kind in ("local", "end_to_end") for k in layer[kind]]
        for j, name in enumerate(names):
            entry = summary[name]["sqnr_db"][layer["layer"]]
            vals = [entry[kind][k] for kind, k in keys]
            ax.bar(np.arange(len(keys)) + (j - len(names) / 2 + 0.5) * 0.8 / len(names), vals, 0.8 / len(names),
                   label=name)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{'e2e' if kind == 'end_to_end' else kind} {k}" for kind, k in keys], rotation=35,
                           ha="right", fontsize=7)
        ax.set_title(f"layer {layer['layer']} ({layer['kind']})", fontsize=9)
    axes[0][0].set_ylabel("gradient SQNR vs fp64 (dB)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "grad_sqnr.png"))
    fig.savefig(paths[-1], dpi=100)
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
    p.add_argument("--moe", action="store_true", help=f"MoE model (defaults {MOE}); else dense ({DENSE})")
    p.add_argument("--large", action="store_true", help=f"larger run for a GPU: {LARGE} (explicit flags override)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None, help="H (multiple of 32)")
    p.add_argument("--d-ff", type=int, default=None, help="I of the dense FFNs (multiple of 32)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--experts", type=int, default=None, help="--moe: E")
    p.add_argument("--top-k", type=int, default=None, help="--moe: experts per token")
    p.add_argument("--d-expert", type=int, default=None, help="--moe: I of each expert (multiple of 32)")
    p.add_argument("--dense-layers", type=int, default=None, help="--moe: leading layers with a dense FFN")
    p.add_argument("--aux-coef", type=float, default=0.01, help="--moe: load-balancing loss weight")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=None, help="default 5%% of the steps")
    p.add_argument("--eval-every", type=int, default=None, help="default steps / 20")
    p.add_argument("--fp8", default="e4m3fn", choices=("e4m3fn", "e5m2"))
    p.add_argument("--configs", default=None, help=f"comma-separated subset of {list(CONFIGS)} (default: dense all "
                                                   f"four, --moe {MOE['configs']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU (default 1: the matmuls are small, and OpenMP spin-waiting on "
                        "a busy machine made 2 threads 20x slower than 1 in our measurements)")
    p.add_argument("--out", default=None, help="default simulations/out/convergence (dense) or convergence_moe")
    p.add_argument("--no-plot", action="store_true", help="skip the PNGs (no matplotlib needed)")
    args = p.parse_args(argv)
    base = dict(MOE if args.moe else DENSE)
    if args.large:
        base.update({k: v for k, v in LARGE.items() if k in base})
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    args.eval_every = args.eval_every if args.eval_every is not None else max(1, args.steps // 20)
    args.out = args.out or os.path.join(_HERE, "out", "convergence_moe" if args.moe else "convergence")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or not names:
        p.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    args.config_names = names
    if args.d_model % args.heads:
        p.error("--d-model must be a multiple of --heads")
    if args.moe and not (0 <= args.dense_layers < args.layers and 1 <= args.top_k <= args.experts):
        p.error(f"--moe needs 0 <= --dense-layers < --layers and 1 <= --top-k <= --experts, got dense_layers="
                f"{args.dense_layers}, layers={args.layers}, top_k={args.top_k}, experts={args.experts}")
    args.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    corpus = load_stdlib_corpus()
    eval_rng = np.random.default_rng(args.seed + 2)
    val = [torch.from_numpy(corpus.batch(eval_rng, "val", args.batch, args.seq + 1)).to(device)
           for _ in range(VAL_BATCHES)]
    probe = torch.from_numpy(corpus.batch(eval_rng, "val", args.batch, args.seq + 1)).to(device)
    info = corpus.describe()
    ffn = (f"layers 0..{args.dense_layers - 1} dense (I={args.d_ff}), then MoE E={args.experts} k={args.top_k} "
           f"I={args.d_expert}" if args.moe else f"dense FFNs I={args.d_ff}")
    print(f"byte LM on {info['train_bytes']} / {info['val_bytes']} bytes of the Python {info['python']} standard "
          f"library (train / held out): H={args.d_model}, {args.layers} layers ({ffn}), seq {args.seq}, batch "
          f"{args.batch}, {args.steps} steps, fp8 {args.fp8}, device {device}; held-out unigram entropy "
          f"{info['val_unigram_entropy_nats']:.4f} nats", flush=True)
    t0 = time.perf_counter()
    results = {name: train(name, args, corpus, val, probe, device) for name in args.config_names}
    summary = summarize(results, info["val_unigram_entropy_nats"])
    header = f"{'config':<10}{'train':>9}{'held-out':>10}{'gap(train)':>12}{'gap(val)':>10}   local SQNR dB per layer"
    print("\n" + header + "\n" + "-" * len(header))
    for name in args.config_names:
        s = summary[name]
        sq = "  ".join("/".join(f"{v:.1f}" for v in layer["local"].values()) for layer in s["sqnr_db"])
        print(f"{name:<10}{s['final_train_loss']:9.4f}{s['final_val_loss']:10.4f}"
              f"{s.get('train_gap_vs_bf16', float('nan')):12.4f}{s.get('val_gap_vs_bf16', float('nan')):10.4f}   {sq}")
    title = "MoE byte LM" if args.moe else "dense byte LM"
    paths = [] if args.no_plot else plot(results, summary, args.out, title)
    payload = {"command": "python simulations/mxfp8_convergence.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "args": {k: v for k, v in vars(args).items() if k != "config_names"}, "corpus": info,
               "torch": torch.__version__, "total_wall_s": time.perf_counter() - t0,
               "configs": {n: CONFIGS[n] for n in args.config_names}, "summary": summary, "history": results,
               "plots": [os.path.basename(p) for p in paths]}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(_rounded(payload), f, default=float)
    print(f"\nwrote {os.path.join(args.out, 'results.json')}" + "".join(f", {p}" for p in paths) +
          f" ({payload['total_wall_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
