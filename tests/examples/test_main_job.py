"""The README's main job (`python -m nkilib.examples.mlp_backward`): exact against mx_exact, and the
modeled time / MFU band line of the same call printed after the error table."""
import re

from nkilib.examples import mlp_backward


def test_main_job_prints_errors_and_the_modeled_band(capsys):
    table = mlp_backward.main(["--model", "qwen3-8b-tp8", "--seq", "32"])
    for name in mlp_backward.OUTPUT_NAMES:
        assert table[name]["vs_mx_exact"]["max_abs"] == 0.0
        assert 0.0 < table[name]["vs_fp32"]["rel_fro"] < 0.1
    line = table["modeled"]
    m = re.search(r"([\d.]+) ms central \(([\d.]+)% of MXFP8 peak\), ([\d.]+) ms pessimistic \(([\d.]+)%\)", line)
    assert m, line
    central, pessimistic = float(m.group(1)), float(m.group(3))
    assert 0.0 < central <= pessimistic  # the pessimistic end is never faster than the central estimate
    assert line in capsys.readouterr().out
