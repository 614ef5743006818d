"""The README's PyTorch training snippet runs as written on CPU and trains (loss decreases)."""
import contextlib
import io
import pathlib
import re

import pytest

pytest.importorskip("torch")

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _pytorch_snippet() -> str:
    text = README.read_text()
    section = text.split("## PyTorch", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_training_snippet_runs_and_loss_decreases():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_pytorch_snippet(), "README.md#pytorch", "exec"), {})
    losses = [float(line.split()[1]) for line in out.getvalue().strip().splitlines()]
    assert len(losses) == 3
    assert losses[2] < losses[0]
