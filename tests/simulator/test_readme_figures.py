"""The README's modeled performance figures are what simulations/mlp_bwd_study.py prints (shape-only runs).

Tolerance: 1% relative on times and ratios, 0.5 points on MFU (the README rounds to 3 significant digits /
0.1 point). The default suite checks the Qwen3-8B TP8 MXFP8 band; the BF16 column and TP1 are slow.
"""
import os
import re

import pytest
from scriptkit import load_script

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
ROWS = {"qwen3-8b-tp8": "Qwen3-8B TP8", "qwen3-8b-tp1": "Qwen3-8B TP1"}


def _study():
    return load_script("mlp_bwd_study")


def _readme_row(model) -> dict:
    """Cells of the README performance table row of `model`, by column header."""
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith("|")]
    header = next(ln for ln in lines if ln.startswith("| shape | MXFP8 time"))
    row = next(ln for ln in lines if ln.startswith(f"| {ROWS[model]} "))
    names = [c.strip() for c in header.strip("|").split("|")]
    return dict(zip(names, (c.strip() for c in row.strip("|").split("|"))))


def _band(cell):
    """"0.731 / 0.835 ms" or "67.3% / 58.9%" -> (central, pessimistic); "refused" -> (None, None)."""
    if cell.startswith("refused"):
        return None, None
    a, b = re.findall(r"[\d.]+", cell)[:2]
    return float(a), float(b)


def _check_band(cell, central, pessimistic, scale, abs_tol=None):
    want = _band(cell)
    got = tuple(None if v is None else v * scale for v in (central, pessimistic))
    for w, g in zip(want, got):
        if w is None or g is None:
            assert w is g, f"README says {cell!r}, the study gives {got}"
        elif abs_tol is not None:
            assert g == pytest.approx(w, abs=abs_tol), f"README says {cell!r}, the study gives {got}"
        else:
            assert g == pytest.approx(w, rel=0.01), f"README says {cell!r}, the study gives {got}"


def _model(model, target, precision):
    from nkilib.models import preset

    study = _study()
    shape = preset(model)
    reports = study.model_mlp_backward(4096, shape.hidden, shape.intermediate, target, precision, 2, False,
                              ("central", "pessimistic"))
    return {sc: study.summarize(r) for sc, r in reports.items()}


def _check_mxfp8(model):
    row = _readme_row(model)
    r = _model(model, "trn3", "mxfp8")
    c, p = r["central"], r["pessimistic"]
    _check_band(row["MXFP8 time"], c["modeled_time_s"], p["modeled_time_s"], 1e3)
    _check_band(row["% of MXFP8 peak"], c["mfu"], p["mfu"], 100, abs_tol=0.5)
    moved, minimum = (float(v) for v in re.findall(r"[\d.]+", row["HBM moved / minimum"])[:2])
    assert c["hbm_bytes"] / 1e6 == pytest.approx(moved, rel=0.01)
    assert c["hbm_compulsory_bytes"] / 1e6 == pytest.approx(minimum, rel=0.01)
    return row, r


def test_readme_tp8_mxfp8_band_matches_the_study():
    _check_mxfp8("qwen3-8b-tp8")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3-8b-tp8", "qwen3-8b-tp1"])
def test_readme_bf16_column_and_speedup_match_the_study(model):
    row, mx = _check_mxfp8(model)
    bf16 = _model(model, "trn3", "bf16")
    _check_band(row["BF16 mode"], bf16["central"]["modeled_time_s"], bf16["pessimistic"]["modeled_time_s"], 1e3)
    if mx["central"]["modeled_time_s"] is None:  # MXFP8 refused: no speedup to quote
        assert row["MXFP8 / BF16"] == ""
        return
    ratio = float(re.findall(r"[\d.]+", row["MXFP8 / BF16"])[0])
    assert bf16["central"]["modeled_time_s"] / mx["central"]["modeled_time_s"] == pytest.approx(ratio, rel=0.01)
