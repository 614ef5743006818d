"""tests/torch: one torch intra-op thread per test process.

The torch tests run small matmuls; with pytest-xdist workers on a 2-core machine, torch's default
of one OpenMP thread per core oversubscribes the CPU, and OpenMP spin-waiting then made the emulate
backend ~20x slower in our measurements.
"""
try:
    import torch
except ImportError:  # the test modules skip themselves (pytest.importorskip)
    torch = None

if torch is not None:
    torch.set_num_threads(1)
