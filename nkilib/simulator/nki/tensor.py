"""`nki.tensor`: the tensor class."""
from ..tensor import NkiTensor  # noqa: F401
