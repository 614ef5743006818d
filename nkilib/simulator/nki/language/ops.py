"""ALU operators and activation functions: the `op=` identifiers of nki.isa
(https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/nki.api.shared.html, "shared tables").

`nl.add`, `nl.silu`, ... are `Op` objects. One object per name; an op may be usable as a binary
ALU op (tensor_tensor/tensor_scalar), as a unary arithmetic op, as a reduction, and/or as an
activation function, as the spec's tables say. All math is done on float32 inputs; functions
are evaluated in float64 and rounded once to float32 (the hardware uses piecewise polynomials,
not published; only `sin`'s un-reduced range is documented and it is not modelled here).
"""
from __future__ import annotations

import numpy as np

_SQRT2 = np.sqrt(2.0)


def _erf64(x):
    """erf in float64, vectorised: Numerical Recipes erfc Chebyshev fit (fractional error < 1.2e-7,
    below float32 resolution after rounding). numpy has no erf and scipy is not a dependency."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    erfc = t * np.exp(poly)
    return np.where(x >= 0, 1.0 - erfc, erfc - 1.0)


def _sigmoid(x):
    return 0.5 * (np.tanh(0.5 * x) + 1.0)  # overflow-free logistic


def _silu_dx(x):
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _softplus(x):
    return np.logaddexp(0.0, x)


class Op:
    """An NKI operator identifier (e.g. `nl.add`, `nl.silu`)."""

    def __init__(self, name, binary=None, unary=None, activation=None, bitvec=False, reduce_identity=None,
                 compare=False):
        self.name = name
        self.binary = binary  # f(a, b) on float32 (or integer for bitvec)
        self.unary = unary  # unary ALU (abs, square, relu, rsqrt, reciprocal, invert)
        self.activation = activation  # ScalarE activation function f(x) evaluated in float64
        self.bitvec = bitvec
        self.reduce_identity = reduce_identity  # not None => legal reduction op
        self.compare = compare

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *args, **kwargs):
        from ...errors import NkiValidationError

        raise NkiValidationError(
            f"nl.{self.name}(...) as a tile-level function is part of the documented nki.language API but is not "
            f"simulated by nkilib's simulator (README, 'Simulator limits'); use it as op= of an nisa instruction")


def _f(fn):
    return lambda *a: fn(*a)


def _abs_max(a, b):
    return np.where(np.abs(a) > np.abs(b), a, b)


def _abs_min(a, b):
    return np.where(np.abs(a) < np.abs(b), a, b)


def _cmp(fn):
    return lambda a, b: fn(a, b).astype(np.float32)


def _logical(fn):
    return lambda a, b: fn(a != 0, b != 0).astype(np.float32)


_OPS = [
    # binary arithmetic (reduce_identity set = legal reduction op, shared tables)
    Op("add", binary=np.add, reduce_identity=0.0),
    Op("subtract", binary=np.subtract, reduce_identity=0.0),
    Op("multiply", binary=np.multiply, reduce_identity=1.0),
    Op("maximum", binary=np.maximum, reduce_identity=-np.inf),
    Op("minimum", binary=np.minimum, reduce_identity=np.inf),
    Op("equal", binary=_cmp(np.equal), compare=True),
    Op("not_equal", binary=_cmp(np.not_equal), compare=True),
    Op("greater_equal", binary=_cmp(np.greater_equal), compare=True),
    Op("greater", binary=_cmp(np.greater), compare=True),
    Op("less_equal", binary=_cmp(np.less_equal), compare=True),
    Op("less", binary=_cmp(np.less), compare=True),
    Op("logical_and", binary=_logical(np.logical_and), reduce_identity=1.0),
    Op("logical_or", binary=_logical(np.logical_or), reduce_identity=0.0),
    Op("logical_xor", binary=_logical(np.logical_xor), reduce_identity=0.0),
    Op("power", binary=np.power),
    Op("abs_max", binary=_abs_max),
    Op("abs_min", binary=_abs_min),
    # bitvec (raw integer bits)
    Op("bitwise_and", binary=np.bitwise_and, bitvec=True, reduce_identity=-1),
    Op("bitwise_or", binary=np.bitwise_or, bitvec=True, reduce_identity=0),
    Op("bitwise_xor", binary=np.bitwise_xor, bitvec=True, reduce_identity=0),
    Op("left_shift", binary=np.left_shift, bitvec=True),
    Op("right_shift", binary=np.right_shift, bitvec=True),  # logical (unsigned view), shared tables
    Op("invert", unary=np.invert, bitvec=True),
    # unary arithmetic that are also activation functions
    Op("abs", unary=np.abs, activation=np.abs),
    Op("square", unary=np.square, activation=np.square),
    Op("relu", unary=lambda x: np.maximum(x, 0), activation=lambda x: np.maximum(x, 0.0)),
    Op("rsqrt", unary=lambda x: 1.0 / np.sqrt(x), activation=lambda x: 1.0 / np.sqrt(x)),
    Op("reciprocal", unary=lambda x: 1.0 / x, activation=lambda x: 1.0 / x),
    # activation functions (shared tables; formulas from nki-library goldens, others standard, INFERRED)
    Op("copy", activation=lambda x: x),
    Op("sigmoid", activation=_sigmoid),
    Op("tanh", activation=np.tanh),
    Op("exp", activation=np.exp),
    Op("log", activation=np.log),
    Op("sqrt", activation=np.sqrt),
    Op("sin", activation=np.sin),
    Op("arctan", activation=np.arctan),
    Op("sign", activation=np.sign),
    Op("silu", activation=lambda x: x * _sigmoid(x)),
    Op("silu_dx", activation=_silu_dx),
    Op("gelu", activation=lambda x: 0.5 * x * (1.0 + _erf64(x / _SQRT2))),
    Op("gelu_dx", activation=lambda x: (0.5 * (1.0 + _erf64(x / _SQRT2))
                                        + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi))),
    Op("gelu_apprx_tanh",
       activation=lambda x: 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))),
    Op("gelu_apprx_sigmoid", activation=lambda x: x * _sigmoid(1.702 * x)),
    Op("gelu_apprx_sigmoid_dx", activation=lambda x: _sigmoid(1.702 * x) * (1.0 + 1.702 * x * _sigmoid(-1.702 * x))),
    Op("softplus", activation=_softplus),
    Op("mish", activation=lambda x: x * np.tanh(_softplus(x))),
    Op("erf", activation=_erf64),
    Op("erf_dx", activation=lambda x: 2.0 / np.sqrt(np.pi) * np.exp(-x * x)),
    Op("bypass"),  # activate2 pass-through stage marker
]

OPS = {op.name: op for op in _OPS}


def evaluate_activation(op: Op, x32: np.ndarray) -> np.ndarray:
    """f(x) for an activation op: float32 in, float64 evaluation, one rounding to float32."""
    with np.errstate(all="ignore"):
        return np.asarray(op.activation(x32.astype(np.float64)), dtype=np.float64).astype(np.float32)
