"""The README's main job (`python -m nkilib.examples.mlp_backward`): exact against mx_exact, and the
modeled time / MFU band line of the same call printed after the error table (or the plan's refusal)."""
import re

from nkilib.examples import mlp_backward
from nkilib.examples.mlp_backward_cost import band_line

BAND = re.compile(r"([\d.]+) ms central \(([\d.]+)% of MXFP8 peak\), ([\d.]+) ms pessimistic \(([\d.]+)%\)")


def test_main_job_prints_errors_and_the_modeled_refusal_at_a_tiny_seq(capsys):
    """At S = 32 (recomputed checkpoints) the model's allocator finds no placement for a 4-bank PSUM tile
    that does not overlap live PSUM tiles it cannot wait for: the job prints the refusal, not a time."""
    table = mlp_backward.main(["--model", "qwen3-8b-tp8", "--seq", "32"])
    for name in mlp_backward.OUTPUT_NAMES:
        assert table[name]["vs_mx_exact"]["max_abs"] == 0.0
        assert 0.0 < table[name]["vs_fp32"]["rel_fro"] < 0.1
    line = table["modeled"]
    assert line.startswith("modeled (trn3, LNC2, mxfp8): refused, the plan does not fit: core ")
    assert "PSUM tile" in line and "has no placement in the target's 16 KiB" in line
    assert not BAND.search(line)
    assert line in capsys.readouterr().out


def test_main_job_band_at_the_readme_seq():
    """The README's command (S = 512) fits: a band whose pessimistic end is never faster than the central."""
    line = band_line(512, 4096, 1536, "trn3", "mxfp8", 2, recompute=True)
    m = BAND.search(line)
    assert m, line
    central, pessimistic = float(m.group(1)), float(m.group(3))
    assert 0.0 < central <= pessimistic
