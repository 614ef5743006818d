"""`nki.dtype` / `nki.language` dtypes: re-exported from the simulator's dtype table."""
from ...dtypes import *  # noqa: F401,F403
from ...dtypes import ALL_DTYPES, NkiDType, as_nki_dtype  # noqa: F401
