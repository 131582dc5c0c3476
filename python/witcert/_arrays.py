"""Arrays from numpy or torch, read in place: the tensor API's one way in.

A numpy array or a CPU torch tensor of float64, float32, float16 or bfloat16 becomes a numpy view of
the same memory (torch through DLPack; bfloat16, which numpy lacks, as its 16-bit storage) and the
dtype code the C API takes. Nothing is copied: an array that is not C-contiguous, not on the CPU or
of another dtype is a ``TypeError`` naming the argument.
"""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

# witcert_dtype's values (include/witcert/witcert.h).
F64, F32, F16, BF16 = 0, 1, 2, 3
_NUMPY_CODES = {np.dtype(np.float64): F64, np.dtype(np.float32): F32, np.dtype(np.float16): F16}


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "__dlpack__")


def view(x: Any, name: str) -> Tuple[np.ndarray, int]:
    """``(numpy view, dtype code)`` of ``x``, sharing its memory."""
    if isinstance(x, np.ndarray):
        code = _NUMPY_CODES.get(x.dtype)
        if code is None:
            raise TypeError(f"{name} must be float64, float32, float16 or bfloat16, got {x.dtype}")
        if not x.flags.c_contiguous:
            raise TypeError(f"{name} must be C-contiguous (np.ascontiguousarray)")
        return x, code
    if is_torch(x):
        import torch

        if x.device.type != "cpu":
            raise TypeError(f"{name} is on {x.device}; the tensor API reads CPU memory (tensor.cpu())")
        if not x.is_contiguous():
            raise TypeError(f"{name} must be contiguous (tensor.contiguous())")
        t = x.detach()
        if t.dtype == torch.bfloat16:
            return np.from_dlpack(t.view(torch.int16)), BF16
        codes = {torch.float64: F64, torch.float32: F32, torch.float16: F16}
        if t.dtype not in codes:
            raise TypeError(f"{name} must be float64, float32, float16 or bfloat16, got {t.dtype}")
        return np.from_dlpack(t), codes[t.dtype]
    raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")


def narrow(x: Any, name: str) -> Tuple[np.ndarray, int]:
    """:func:`view` for keys and queries, which are taken as float32, float16 or bfloat16: float64
    would be rounded to float32, and a witness of rounded keys need not bound the given ones' error."""
    v, code = view(x, name)
    if code == F64:
        raise TypeError(f"{name} is float64: keys and queries are taken as float32, float16 or bfloat16")
    return v, code


def float32(x: Any, name: str) -> np.ndarray:
    """``x`` as a C-contiguous float32 numpy array: in place when it is one, else converted (the
    cache stores fp16 from float32 activations, so a wider or narrower input is rounded once here)."""
    if isinstance(x, np.ndarray):
        if x.dtype == np.float32 and x.flags.c_contiguous:
            return x
        if x.dtype.kind != "f":
            raise TypeError(f"{name} must be a float array, got {x.dtype}")
        return np.ascontiguousarray(x, dtype=np.float32)
    if is_torch(x):
        import torch

        t = x.detach()
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
        return np.from_dlpack(t.to(device="cpu", dtype=torch.float32).contiguous())
    raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")


def as_given(given: Any, x: np.ndarray) -> Any:
    """``x`` (float32 numpy) as the kind of array the caller gave: a torch tensor sharing its memory
    when ``given`` is one, else ``x`` itself."""
    if is_torch(given):
        import torch

        return torch.from_numpy(x)
    return x
