"""Code that runs inside an `nki.jit` body uses only constructs the NKI compiler guide allows.

The NKI 0.3.0 update guide, "Language Restrictions": "The NKI 0.3.0 compiler does not support Python's
`is` / `is not` operators ... Use `==` / `!=` instead"
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/migration/nki-0-3-0-update-guide.html).
The NKI language guide, "NKI Values": dictionary keys "must be string values"
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/get-started/nki-language-guide.html).
Our simulator traces plain Python, so it cannot catch these; this test reads the traced modules' source.
docs/kernel-structure.md lists which modules are traced.
"""
import ast
import pathlib

import pytest

import nkilib

ROOT = pathlib.Path(nkilib.__file__).parent

# Every module whose functions run inside the traced kernel bodies (docs/kernel-structure.md, "raising exceptions").
TRACED_MODULES = (
    "experimental/mlp_mxfp8/mlp_bwd_mxfp8/api.py",
    "experimental/mlp_mxfp8/mlp_bwd_mxfp8/config.py",
    "experimental/mlp_mxfp8/mlp_bwd_mxfp8/mlp_bwd_mxfp8_epilogue.py",
    "experimental/mlp_mxfp8/mlp_bwd_mxfp8/mlp_bwd_mxfp8_kernel.py",
    "experimental/moe_mxfp8/moe_bwd_mxfp8_kernel.py",
    "experimental/moe_mxfp8/moe_bwd_mxfp8_weight_grads.py",
    "experimental/moe_mxfp8/moe_bwd_mxfp8_bias_grad.py",
    "core/kernel_helpers.py",
    "core/options.py",
    "core/phase_graph.py",
    "core/swiglu.py",
    "core/matmul/constants.py",
    "core/matmul/descriptor.py",
    "core/matmul/overlap.py",
    "core/matmul/panels.py",
    "core/matmul/plan.py",
    "core/matmul/row_panels.py",
    "core/matmul/sources.py",
    "core/matmul/streamed.py",
)


def _identity_comparisons(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for op in node.ops:
                if isinstance(op, (ast.Is, ast.IsNot)):
                    yield node.lineno


def _int_keyed_dict_literals(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key in node.keys:
                if isinstance(key, ast.Constant) and isinstance(key.value, int):
                    yield node.lineno


@pytest.mark.parametrize("module", TRACED_MODULES)
def test_traced_module_has_no_identity_comparison(module):
    tree = ast.parse((ROOT / module).read_text())
    lines = list(_identity_comparisons(tree))
    assert lines == [], f"{module}: `is` / `is not` at lines {lines}; the NKI compiler wants `==` / `!=`"


@pytest.mark.parametrize("module", TRACED_MODULES)
def test_traced_module_has_no_int_keyed_dict(module):
    tree = ast.parse((ROOT / module).read_text())
    lines = list(_int_keyed_dict_literals(tree))
    assert lines == [], f"{module}: dict literal with int keys at lines {lines}; NKI dict keys must be strings"


def test_the_check_sees_an_identity_comparison():
    """The detector itself finds `is None` (so an empty result above means something)."""
    tree = ast.parse("def f(x):\n    return x is None or x is not None\n")
    assert list(_identity_comparisons(tree)) == [2, 2]
