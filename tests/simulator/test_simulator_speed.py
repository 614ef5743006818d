"""Smoke test of the simulator speed benchmark (simulations/simulator_speed.py) on a small shape."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "simulations", "simulator_speed.py")


def _load():
    spec = importlib.util.spec_from_file_location("simulator_speed", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_simulator_speed_main_small_shape(capsys):
    res = _load().main(["--shape", "256", "512", "512", "--lnc", "1"])
    # LNC1, 2 M tiles, 1 K tile: B panel (dma_copy, tensor_copy, quantize_mx) + per M tile
    # (dma_transpose, quantize_mx, nc_matmul_mx, tensor_copy, dma_copy) = 3 + 2 * 5
    assert res["instructions"] == 13
    assert res["mix"]["nc_matmul_mx"] == 2 and res["mix"]["quantize_mx"] == 3
    assert res["output_shape"] == (256, 512)
    assert res["wall_s"] > 0 and res["instr_per_s"] > 0
    assert "instr/s" in capsys.readouterr().out
