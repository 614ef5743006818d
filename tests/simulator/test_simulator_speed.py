"""Smoke test of the simulator speed benchmark (simulations/simulator_speed.py) on a small shape."""
from scriptkit import load_script


def _load():
    return load_script("simulator_speed")


def test_simulator_speed_main_small_shape(capsys):
    res = _load().main(["--shape", "256", "512", "512", "--lnc", "1"])
    # LNC1, 2 M tiles, 1 K tile: B panel (dma_copy, tensor_copy, quantize_mx) + per M tile
    # (dma_transpose, quantize_mx, nc_matmul_mx, tensor_copy, dma_copy) = 3 + 2 * 5
    assert res["instructions"] == 13
    assert res["mix"]["nc_matmul_mx"] == 2 and res["mix"]["quantize_mx"] == 3
    assert res["output_shape"] == (256, 512)
    assert res["wall_s"] > 0 and res["instr_per_s"] > 0
    assert "instr/s" in capsys.readouterr().out
