"""The floating dtypes a model computes in, by the names configs and checkpoints give them.

One table for ``model.dtype``, a checkpoint's ``torch_dtype`` and the dtype
name the engine sends its tensor-parallel workers.
"""

from __future__ import annotations

import torch

#: the compute dtypes by name (``model.dtype`` also takes ``auto``: the checkpoint's own)
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
