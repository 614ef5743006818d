"""Model shape presets (hidden size H, per-TP-shard intermediate size I) for examples and studies.

Sources: the models' public configs (hidden_size / intermediate_size); I is divided by the tensor-
parallel degree. Expert shapes use the per-expert intermediate size.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MlpShape:
    name: str
    hidden: int  # H
    intermediate: int  # I per shard


def _tp(name, hidden, intermediate, tps):
    return {f"{name}-tp{tp}": MlpShape(f"{name}-tp{tp}", hidden, intermediate // tp) for tp in tps}


PRESETS = {
    **_tp("qwen3-8b", 4096, 12288, (1, 4, 8)),
    **_tp("qwen3-32b", 5120, 25600, (1, 4, 8)),
    **_tp("llama3-8b", 4096, 14336, (8,)),
    **_tp("llama3-70b", 8192, 28672, (8,)),
    "gpt-oss-20b-expert": MlpShape("gpt-oss-20b-expert", 2880, 2880),
    "deepseek-v3-expert": MlpShape("deepseek-v3-expert", 7168, 2048),
}


def preset(name: str) -> MlpShape:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
