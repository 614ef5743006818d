"""Simulator settings read from the environment, in one place.

| variable | default | meaning |
|---|---|---|
| NEURON_PLATFORM_TARGET_OVERRIDE | trn3 | trn2/gen3 or trn3/gen4 (official default trn3: [SIM]) |
| NKI_NC_VERSION | (unset) | gen3/gen4, honoured when the override above is unset (nki-library harness) |
| NKI_PRECISE_FP | 1 | 1: low-precision floats stored with real rounding (ml_dtypes); 0: stored as fp32 ([SIM]) |
| NKILIB_SIM_STRICT | 1 | 1: raise on reads of never-written elements (ours; the official simulator only NaN-fills) |
| NKILIB_QMX_SCALE_RULE | neuron | quantize_mx scale rule: "neuron" (SDK 2.31+, default) or "ocp_floor" (<= 2.30) [QMX] |

[QMX]: docs/simulator.md#choice-qmx-scale-rule (alt-emax vs the OCP floor rule).
[SIM]: the NKI CPU simulator guide,
https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/guides/nki_simulator.html

Settings are read once per kernel launch, so a test may change them between launches.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .hardware import TargetSpec, resolve_target

QMX_SCALE_RULES = ("neuron", "ocp_floor")


def _flag(name: str, default: str) -> bool:
    raw = os.environ.get(name, default).strip()
    if raw not in ("0", "1"):
        raise ValueError(f"environment variable {name} must be '0' or '1', got {raw!r}")
    return raw == "1"


@dataclass(frozen=True)
class Settings:
    target: TargetSpec
    precise_fp: bool
    strict: bool
    qmx_scale_rule: str


def current_settings() -> Settings:
    """Read the settings from the environment (see module docstring)."""
    target_name = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE") or os.environ.get("NKI_NC_VERSION") or "trn3"
    rule = os.environ.get("NKILIB_QMX_SCALE_RULE", "neuron").strip()
    if rule not in QMX_SCALE_RULES:
        raise ValueError(f"NKILIB_QMX_SCALE_RULE must be one of {QMX_SCALE_RULES}, got {rule!r}")
    return Settings(
        target=resolve_target(target_name),
        precise_fp=_flag("NKI_PRECISE_FP", "1"),
        strict=_flag("NKILIB_SIM_STRICT", "1"),
        qmx_scale_rule=rule,
    )
