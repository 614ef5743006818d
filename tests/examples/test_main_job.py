"""The README's main job (`python -m nkilib.examples.mlp_backward`): exact against mx_exact, and the
modeled time / MFU band line of the same call printed after the error table (or the plan's refusal)."""
import dataclasses
import re

from nkilib.examples import mlp_backward, mlp_backward_cost
from nkilib.examples.mlp_backward_cost import band_line
from nkilib.simulator.hardware import resolve_target

BAND = re.compile(r"([\d.]+) ms central \(([\d.]+)% of MXFP8 peak\), ([\d.]+) ms pessimistic \(([\d.]+)%\)")


def test_main_job_prints_errors_and_the_modeled_refusal_at_a_tiny_seq(capsys, monkeypatch):
    """When the plan does not fit the target, the job prints the refusal, not a time. S = 32 (recomputed checkpoints)
    fits trn3 since round 50b's PSUM placement rule (it was refused for a 4-bank PSUM tile), so the model here runs
    on trn3 with 96 KiB of SBUF per partition (the plan needs ~122 KiB); the numerics run on the real target."""
    real_model_kernel = mlp_backward_cost.model_kernel

    def on_a_small_sbuf(fn, inputs, **kw):
        kw["target"] = dataclasses.replace(resolve_target(kw["target"]), sbuf_bytes_per_partition=96 * 1024)
        return real_model_kernel(fn, inputs, **kw)

    monkeypatch.setattr(mlp_backward_cost, "model_kernel", on_a_small_sbuf)
    table = mlp_backward.main(["--model", "qwen3-8b-tp8", "--seq", "32"])
    for name in mlp_backward.OUTPUT_NAMES:
        assert table[name]["vs_mx_exact"]["max_abs"] == 0.0
        assert 0.0 < table[name]["vs_fp32"]["rel_fro"] < 0.1
    line = table["modeled"]
    assert line.startswith("modeled (trn3, LNC2, mxfp8): refused, the plan does not fit: core ")
    assert re.search(r"the plan needs [\d.]+ KiB of SBUF per partition, the target has 96 KiB", line), line
    assert not BAND.search(line)
    assert line in capsys.readouterr().out


def test_main_job_band_at_the_readme_seq():
    """The README's command (S = 512) fits: a band whose pessimistic end is never faster than the central."""
    line = band_line(512, 4096, 1536, "trn3", "mxfp8", 2, recompute=True)
    m = BAND.search(line)
    assert m, line
    central, pessimistic = float(m.group(1)), float(m.group(3))
    assert 0.0 < central <= pessimistic
