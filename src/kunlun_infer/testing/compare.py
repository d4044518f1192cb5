"""Compare a plugin's result with the reference's and explain any difference in one message."""

from __future__ import annotations

from typing import Any

import torch

from kunlun_infer.ops import TOLERANCES


class ConformanceError(AssertionError):
    """A plugin does not behave as the contract says; the message names what and by how much."""


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype`` (float32's for dtypes without an entry)."""
    return TOLERANCES.get(dtype, TOLERANCES[torch.float32])


def assert_matches(got: Any, want: Any, *, what: str, dtype: torch.dtype, path: str = "result") -> None:
    """Raise :class:`ConformanceError` unless ``got`` equals ``want`` within ``dtype``'s tolerance."""
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            raise ConformanceError(f"{what}: {path} should be a sequence of {len(want)}, got {type(got).__name__}")
        for i, (g, w) in enumerate(zip(got, want)):
            assert_matches(g, w, what=what, dtype=dtype, path=f"{path}[{i}]")
        return
    if not isinstance(want, torch.Tensor):
        if got != want:
            raise ConformanceError(f"{what}: {path} is {got!r}, the reference gives {want!r}")
        return
    if not isinstance(got, torch.Tensor):
        raise ConformanceError(f"{what}: {path} should be a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        raise ConformanceError(f"{what}: {path} has shape {tuple(got.shape)} {got.dtype}, the reference gives "
                               f"{tuple(want.shape)} {want.dtype}")
    rtol, atol = tolerance(dtype)
    exact = not want.is_floating_point()  # indices, ids, counts: asked before the float64 view below
    g, w = got.detach().cpu().to(torch.float64), want.detach().cpu().to(torch.float64)
    if exact and not torch.equal(g, w):
        raise ConformanceError(f"{what}: {path} differs from the reference (exact match required)")
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    if bool(bad.any()):
        err = (g - w).abs().nan_to_num(float("inf"))
        worst = int(err.argmax())
        raise ConformanceError(
            f"{what}: {path} differs from the reference beyond tolerance rtol={rtol}, atol={atol}: "
            f"{int(bad.sum())} of {bad.numel()} elements, max abs error {float(err.max()):.3g} "
            f"(got {float(g.flatten()[worst]):.6g}, want {float(w.flatten()[worst]):.6g})")
