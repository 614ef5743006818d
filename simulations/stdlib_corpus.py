"""A real-text byte corpus that ships with every Python: the standard library's own top-level sources.

Used by simulations/mxfp8_convergence.py (no downloads, no generated data). Selection is deterministic:
the ``*.py`` files directly in ``sysconfig.get_paths()["stdlib"]`` (no sub-packages), sorted by name;
every tenth file (positions 9, 19, 29, ... of the sorted list) is held out for validation, the rest
is the training text. Files are read as bytes and joined with a newline; the vocabulary is the 256
byte values. The texts differ between Python versions, so ``ByteCorpus.describe()`` records the
version, the file counts, the sizes and a SHA-256 of each split.

Dimensions:
    train / val: [N] uint8 byte arrays; batches [batch, seq + 1] int64 token ids in [0, 256).
"""
from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass

import numpy as np

VOCAB = 256  # byte-level
HELD_OUT_EVERY = 10  # every tenth file (sorted by name) is validation text


@dataclass(frozen=True)
class ByteCorpus:
    """Training and held-out bytes of the standard library (module docstring)."""

    root: str
    train_files: tuple
    val_files: tuple
    train: np.ndarray
    val: np.ndarray

    def batch(self, rng: np.random.Generator, split: str, batch: int, length: int) -> np.ndarray:
        """`batch` windows of `length` consecutive bytes at uniformly random offsets of `split`.

        Dimensions:
            -> [batch, length] int64.
        """
        data = self.train if split == "train" else self.val
        if len(data) <= length:
            raise ValueError(f"ByteCorpus.batch: the {split} split has {len(data)} bytes, fewer than a window of "
                             f"{length}")
        starts = rng.integers(0, len(data) - length, batch)
        return data[starts[:, None] + np.arange(length)].astype(np.int64)

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the held-out byte frequencies: the loss of a model that ignores context."""
        counts = np.bincount(self.val, minlength=VOCAB).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def describe(self) -> dict:
        return {"source": "Python standard library top-level *.py files", "root": self.root,
                "python": platform.python_version(), "held_out": f"every {HELD_OUT_EVERY}th file by sorted name",
                "train_files": len(self.train_files), "val_files": len(self.val_files),
                "train_bytes": int(len(self.train)), "val_bytes": int(len(self.val)),
                "train_sha256": hashlib.sha256(self.train.tobytes()).hexdigest(),
                "val_sha256": hashlib.sha256(self.val.tobytes()).hexdigest(),
                "val_unigram_entropy_nats": self.unigram_entropy()}


def _join(root: str, names) -> np.ndarray:
    parts = []
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            parts.append(f.read())
    return np.frombuffer(b"\n".join(parts), dtype=np.uint8)


def load_stdlib_corpus(root: str | None = None) -> ByteCorpus:
    """The corpus of `root` (default: this interpreter's standard library directory).

    Raises:
        FileNotFoundError: fewer than HELD_OUT_EVERY source files in `root`.
    """
    root = root or sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py") and os.path.isfile(os.path.join(root, n)))
    if len(names) < HELD_OUT_EVERY:
        raise FileNotFoundError(f"load_stdlib_corpus: expected at least {HELD_OUT_EVERY} *.py files in {root!r}, "
                                f"found {len(names)}")
    val = tuple(n for i, n in enumerate(names) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1)
    train = tuple(n for n in names if n not in set(val))
    return ByteCorpus(root=root, train_files=train, val_files=val, train=_join(root, train), val=_join(root, val))
