"""Host-side view of a value that may be traced: the one place input checks ask "is it concrete?"."""

from __future__ import annotations

import jax
import numpy as np


def concrete(x) -> np.ndarray | None:
    """``x`` as a NumPy array when it is concrete, ``None`` when it is traced under ``jit``."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None
