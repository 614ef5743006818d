"""Smoke tests of the torch-side scripts in simulations/ (tiny sizes; the studies themselves are not tests)."""
from __future__ import annotations

import json
import math
import os

import pytest
from scriptkit import load_script

torch = pytest.importorskip("torch")

_SIM = os.path.join(os.path.dirname(__file__), "..", "..", "simulations")


_load = load_script


def _plot_flags():
    try:
        import matplotlib  # noqa: F401
        return []
    except ImportError:
        return ["--no-plot"]


def _check_study(res, tmp_path, configs, layer_kinds):
    summary = res["summary"]
    assert set(res["history"]) == set(configs)
    for name, h in res["history"].items():
        assert len(h["train_loss"]) == 20 and h["eval_step"] == [10, 20]
        assert all(math.isfinite(v) for v in h["train_loss"])
        assert h["train_loss"][-1] < h["train_loss"][0]  # it learns something in 20 steps
        # real text: after 20 steps the held-out loss is below uniform bytes (log 256 = 5.55 nats)
        assert h["val_loss"][-1] < math.log(256)
    assert summary["bf16"]["train_gap_vs_bf16"] == 0.0
    assert [layer["kind"] for layer in summary["bf16"]["sqnr_db"]] == layer_kinds
    # SQNR: BF16 backward ~45-50 dB, MXFP8 e4m3fn ~25-33 dB (2**-4 relative element error)
    for layer in summary["bf16"]["sqnr_db"]:
        assert all(v > 38 for v in layer["local"].values()), layer
    for layer in summary["neuron"]["sqnr_db"]:
        assert all(18 < v < 38 for v in layer["local"].values()), layer
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"]["_unigram_entropy"] == pytest.approx(summary["_unigram_entropy"])
    return saved


def test_convergence_study_runs_20_steps(tmp_path, capsys):
    plot = _plot_flags()
    res = _load("mxfp8_convergence").main(
        ["--steps", "20", "--eval-every", "10", "--d-model", "64", "--d-ff", "96", "--layers", "2", "--heads", "2",
         "--seq", "16", "--batch", "4", "--lr", "1e-2", "--device", "cpu", "--out", str(tmp_path), *plot])
    _check_study(res, tmp_path, ("bf16", "neuron", "rceil", "ocp_floor"), ["dense", "dense"])
    if not plot:
        assert (tmp_path / "loss_curves.png").stat().st_size > 0 and (tmp_path / "grad_sqnr.png").exists()
    assert "gap(train)" in capsys.readouterr().out


def test_convergence_study_moe_runs_20_steps(tmp_path):
    res = _load("mxfp8_convergence").main(
        ["--moe", "--steps", "20", "--eval-every", "10", "--d-model", "64", "--d-ff", "96", "--layers", "2",
         "--heads", "2", "--seq", "16", "--batch", "4", "--experts", "4", "--top-k", "2", "--d-expert", "32",
         "--lr", "1e-2", "--device", "cpu", "--out", str(tmp_path), "--no-plot"])
    saved = _check_study(res, tmp_path, ("bf16", "neuron"), ["dense", "moe"])
    moe_layer = res["summary"]["neuron"]["sqnr_db"][1]
    assert set(moe_layer["local"]) == {"dX", "d_topk_weights", "dW_gate_up", "dW_down"}
    assert set(moe_layer["end_to_end"]) == {"dW_gate_up", "dW_down", "dW_router"}
    assert saved["command"].startswith("python simulations/mxfp8_convergence.py --moe --steps 20")


def test_stdlib_corpus_split_is_deterministic():
    corpus_mod = _load("stdlib_corpus")
    a, b = corpus_mod.load_stdlib_corpus(), corpus_mod.load_stdlib_corpus()
    assert a.describe() == b.describe()
    assert not set(a.train_files) & set(a.val_files)
    names = sorted(a.train_files + a.val_files)
    assert a.val_files == tuple(names[9::10])
    import numpy as np

    batch = a.batch(np.random.default_rng(0), "val", 3, 17)
    assert batch.shape == (3, 17) and batch.dtype == np.int64 and 0 <= batch.min() and batch.max() < 256
    start = bytes(batch[0].astype(np.uint8)).decode("latin-1")
    assert start in bytes(a.val).decode("latin-1")  # windows of the held-out text itself


def test_profile_script_off_neuron_exits_with_a_clear_message(capsys):
    mod = _load("profile_mlp_bwd_neuron")
    assert mod.main(["--shape", "256", "256", "256"]) == mod.NOT_ON_NEURON_EXIT
    err = capsys.readouterr().err
    assert "not on a Neuron instance" in err and "--predict-only" in err


def test_profile_script_prediction_and_report():
    mod = _load("profile_mlp_bwd_neuron")
    args = mod.parse_args(["--shape", "256", "256", "128", "--lnc", "1"])
    pred = mod.predict(args.S, args.H, args.I, args.lnc, args.target, args.precision, False)
    assert pred["model_flops"] == 12 * 256 * 256 * 128
    assert 0 < pred["mfu"] < 1 and pred["modeled_time_s"] > 0 and "tensor" in pred["engine_utilisation"]
    # the table with a (made-up) measurement, as printed on a Neuron host
    measured = {"time_s": 2 * pred["modeled_time_s"], "utilisation": {"summary.pe_util": 0.5}}
    text = mod.report(args, measured, pred)
    assert "device time" in text and "MFU" in text and "summary.pe_util" in text
    mfu_line = next(line for line in text.splitlines() if line.startswith("MFU"))
    measured_mfu, modeled_mfu = (float(v) for v in mfu_line.split()[-2:])
    assert measured_mfu == pytest.approx(modeled_mfu / 2, abs=0.01)  # twice the modeled time: half the MFU


def test_profile_script_follows_the_documented_neuron_explorer_flow(tmp_path, monkeypatch):
    """The command lines and environment of the on-device flow (not runnable here: no Neuron device)."""
    mod = _load("profile_mlp_bwd_neuron")
    capture, view = mod.capture_commands("k.neff", "k.ntff")
    assert capture == ["neuron-explorer", "capture", "-n", "k.neff", "-s", "k.ntff", "--profile-nth-exec=2"]
    assert view == ["neuron-explorer", "view", "-n", "k.neff", "-s", "k.ntff", "--output-format", "summary-json"]
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    args = mod.parse_args(["--shape", "256", "256", "128", "--lnc", "2", "--out", str(tmp_path)])
    env = mod.kernel_env(args)
    assert env["NEURON_FRAMEWORK_DEBUG"] == "1" and env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert env["NEURON_PLATFORM_TARGET_OVERRIDE"] == "trn3"
    assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "neff")
    src = open(os.path.join(_SIM, "profile_mlp_bwd_neuron.py")).read()
    assert "nki.benchmark(" not in src and "nki.profile(" not in src
    # the largest NEFF is the kernel's
    (tmp_path / "neff" / "a").mkdir(parents=True)
    (tmp_path / "neff" / "a" / "small.neff").write_bytes(b"x")
    (tmp_path / "neff" / "big.neff").write_bytes(b"x" * 10)
    assert mod.find_neff(str(tmp_path / "neff")) == str(tmp_path / "neff" / "big.neff")
    assert mod.find_neff(str(tmp_path / "none")) is None
    # summary-json: numeric fields flattened; the device time by key, unit from the suffix
    nums = mod.summary_numbers({"summary": [{"total_time_us": 640.0, "pe_utilization": 0.7, "name": "k"}]})
    assert nums == {"summary.0.total_time_us": 640.0, "summary.0.pe_utilization": 0.7}
    assert mod.device_time_s(nums, None) == pytest.approx(640e-6)
    assert mod.device_time_s(nums, "pe_utilization") == 0.7 and mod.device_time_s({}, None) is None


def test_emulate_speed_script_times_and_checks(tmp_path, capsys):
    """simulations/emulate_speed.py --quick on the CPU: a row with positive times, consistent ratios and
    a breakdown, the device-vs-CPU identity check (CPU vs CPU here, eager quantizer: must hold, and the
    quantizer vs nkilib.mx on adversarial values), the JSON and the printed table."""
    out = tmp_path / "speed.json"
    res = _load("emulate_speed").main(["--devices", "cpu", "--quick", "--warmup", "0", "--check", "--out", str(out)])
    (run,) = res["runs"]
    (row,) = run["rows"]
    assert (row["S"], row["H"], row["I"]) == (128, 256, 192)
    for key in ("plain_bwd_ms", "emulate_bwd_ms", "plain_step_ms", "emulate_step_ms", "emulate_fast_bwd_ms",
                "emulate_fast_step_ms"):
        assert row[key] > 0, key
    for key in ("quantize_ms", "quantize_eager_ms", "gemm_f64_ms", "gemm_plain_ms", "gemm_fast_ms"):
        assert row["breakdown"][key] > 0, key
    assert row["ratio_bwd"] == pytest.approx(row["emulate_bwd_ms"] / row["plain_bwd_ms"])
    assert row["ratio_fast_bwd"] == pytest.approx(row["emulate_fast_bwd_ms"] / row["plain_bwd_ms"])
    # emulate_fast (fp32 GEMMs on the CPU) is close to, and not identical with, the exact emulation
    assert row["breakdown"]["gemm_fast"] == "fp32"
    assert set(row["fast_vs_exact"]) == {"dX", "dW_gate_up", "dW_down"}
    assert all(d["norm_rel"] < 1e-4 for d in row["fast_vs_exact"].values())
    assert any(d["differ"] > 0 for d in row["fast_vs_exact"].values())
    # which quantizer ran (this process's earlier tests may have compiled one: either wording is right)
    assert run["quantizer_status"].startswith(("compiled (torch.compile", "eager"))
    assert run["device_matches_cpu_bitwise"] is True
    assert run["env"]["plain_dtype"] == "float32" and run["env"]["quantizer"] == "auto"
    assert json.loads(out.read_text())["runs"][0]["rows"][0]["S"] == 128
    printed = capsys.readouterr().out
    assert "plain bwd" in printed and "float64 GEMMs" in printed
    assert "emulate_fast vs emulate" in printed and "MX quantizer used for the timings above" in printed


def test_moe_emulate_speed_script_times_and_checks(tmp_path):
    """simulations/moe_emulate_speed.py --quick on the CPU: positive times, ratios that are the times' quotients,
    the device-vs-CPU identity check (CPU vs CPU here: every count 0) and the JSON."""
    out = tmp_path / "moe_speed.json"
    res = _load("moe_emulate_speed").main(["--devices", "cpu", "--quick", "--warmup", "0", "--check",
                                           "--out", str(out)])
    (run,) = res["runs"]
    (row,) = run["rows"]
    assert (row["T"], row["H"], row["I"], row["E"], row["k"]) == (96, 128, 64, 4, 2)
    for name in ("plain", "emulate", "emulate_fast"):
        assert row[f"{name}_step_ms"] > 0 and row[f"{name}_bwd_ms"] > 0, name
    assert row["ratio_emulate_bwd"] == pytest.approx(row["emulate_bwd_ms"] / row["plain_bwd_ms"])
    assert row["ratio_emulate_fast_step"] == pytest.approx(row["emulate_fast_step_ms"] / row["plain_step_ms"])
    check = run["device_matches_cpu_bitwise"]
    assert set(check) == {"swiglu", "gpt_oss_clamped"}
    for parts in check.values():
        assert set(parts) == {"backward", "forward", "op"}
        assert set(parts["backward"]) == {"dX", "d_topk_weights", "dW_gate_up", "dW_down"}
        assert all(v == 0 for flags in parts.values() for v in flags.values()), parts
    assert json.loads(out.read_text())["runs"][0]["rows"][0]["E"] == 4


@pytest.mark.parametrize("clamped", [False, True])
def test_moe_emulate_speed_baseline_is_the_same_function(clamped):
    """The script's plain autograd baseline computes the op's function: float32 plain_moe against the op's bf16
    forward (emulate backend) within bf16 rounding, plain SwiGLU and GPT-OSS's clamped one (inputs scaled so the
    clamps bite)."""
    mod = _load("moe_emulate_speed")
    t = mod.make_inputs(64, 128, 96, 6, 3, "cpu", seed=3, empty_expert=True)
    clamps = mod.GPT_OSS_CLAMPS if clamped else None
    x = t["x"] * (8 if clamped else 1)
    got = mod.moe_swiglu_experts_mxfp8(x, t["topk_ids"], t["topk_weights"], t["gate_up_weight"], t["down_weight"],
                                       clamp_limits=clamps, backend="emulate").float()
    want = mod.plain_moe(x.float(), t["topk_ids"], t["topk_weights"], t["gate_up_weight"].float(),
                         t["down_weight"].float(), clamps)
    if clamped:  # the clamps bite: some gate pre-activations above 7
        assert float((x.float() @ t["gate_up_weight"][0, :96].float().T).max()) > 7
    err = float((got - want).norm() / want.norm())
    assert err < 2e-2, err
