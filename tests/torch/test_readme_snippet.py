"""The README's PyTorch and training-integration snippets run as written on CPU (losses decrease)."""
import contextlib
import io
import pathlib
import re
import socket

import pytest

pytest.importorskip("torch")

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _snippets(heading: str) -> list:
    """The ```python blocks of the README section that starts with `heading` (up to the next '## ')."""
    section = README.read_text().split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _run(code: str, name: str) -> list:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md#{name}", "exec"), {})
    return out.getvalue().strip().splitlines()


def _losses(lines):
    return [float(line.split()[1]) for line in lines if re.fullmatch(r"\d+ \S+", line)]


def test_readme_training_snippet_runs_and_loss_decreases():
    losses = _losses(_run(_snippets("## PyTorch")[0], "pytorch"))
    assert len(losses) == 3
    assert losses[2] < losses[0]


def test_readme_training_integration_snippets_run(monkeypatch):
    pytest.importorskip("transformers")
    patch_snippet, tp_snippet, ep_snippet = _snippets("## Training integration")
    lines = _run(patch_snippet, "training-integration")
    assert lines[0] == "('model.layers.0.mlp', 'model.layers.1.mlp')"
    losses = _losses(lines[1:])
    assert len(losses) == 3 and losses[2] < losses[0]
    # the tensor-parallel snippet as `torchrun --nproc-per-node 1` would start it (env:// rendezvous)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                        ("WORLD_SIZE", "1"), ("GLOO_SOCKET_IFNAME", "lo")):
        monkeypatch.setenv(name, value)
    assert _run(tp_snippet, "tensor-parallel") == ["0 (512, 64) torch.Size([32, 1, 64])"]
    assert _run(ep_snippet, "expert-parallel") == ["0 (8, 256, 64) torch.Size([32, 64])"]
