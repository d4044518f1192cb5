"""Conformance of an ops provider: every op it supports, against its reference, per dtype.

``pack_linear_weight`` and ``linear`` are checked together
(``linear(x, pack(w), b)`` against the reference ``linear(x, w, b)``), since
only the provider's own ``linear`` understands its packed weights; so are
``pack_int8_linear_weight`` and ``int8_linear``, and ``pack_moe_weights``
and ``fused_moe``. For ops that mutate an argument (``store_kv``) the
mutated argument is compared. An op with several ``variants`` (``moe_route``:
softmax, grouped, sigmoid with a correction bias) is checked in each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kunlun_infer.ops import OP_SPECS, TOLERANCES, reference
from kunlun_infer.testing.compare import ConformanceError, assert_matches, tolerance


#: op -> (the op that packs a weight, the op that multiplies with it): checked together, as the pair
_PACKED_PAIRS = {op: pair for pair in (("pack_linear_weight", "linear"), ("pack_int8_linear_weight", "int8_linear"),
                                      ("pack_moe_weights", "fused_moe"))
                 for op in pair}


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


def check_op(provider: Any, op: str, dtype: torch.dtype, device: torch.device, *, seed: int = 0) -> None:
    """Raise :class:`ConformanceError` naming op, dtype and tolerance when ``op`` misbehaves."""
    spec = OP_SPECS[op]
    rtol, atol = tolerance(dtype)
    what = f"op '{op}' ({dtype}, tolerance rtol={rtol} atol={atol})"
    args, kwargs = spec.sample(dtype, device, torch.Generator().manual_seed(seed))
    if op in _PACKED_PAIRS:
        pack_op, use_op = _PACKED_PAIRS[op]
        if op == pack_op:  # checked through the op that uses the packed weight, with that op's sample inputs
            args, kwargs = OP_SPECS[use_op].sample(dtype, device, torch.Generator().manual_seed(seed))
            if not provider.supports(use_op):
                raise ConformanceError(f"{what}: the provider packs weights but has no '{use_op}' to use them")
        x, weight, *rest = args  # the op that uses a packed weight takes it second: use_op(x, packed, ...)
        pack = provider.get(pack_op) if provider.supports(pack_op) else getattr(reference, pack_op)
        weight_parts = weight if isinstance(weight, tuple) else (weight,)
        packed = pack(*_clone(weight_parts))
        got = provider.get(use_op)(x.clone(), packed, *_clone(rest))
        want = getattr(reference, use_op)(x, getattr(reference, pack_op)(*weight_parts), *rest)
        assert_matches(got, want, what=f"{what} via {use_op}(x, pack(w), ...)", dtype=dtype)
        return
    mine_args, ref_args = _clone(args), _clone(args)
    got = provider.get(op)(*mine_args, **_clone(kwargs))
    want = spec.reference(*ref_args, **_clone(kwargs))
    if spec.in_place_arg is not None:
        i = spec.in_place_arg
        assert_matches(mine_args[i], ref_args[i], what=what, dtype=dtype, path=f"argument {i} (updated in place)")
        if spec.name == "store_kv":  # both caches are written
            assert_matches(mine_args[i + 1], ref_args[i + 1], what=what, dtype=dtype,
                           path=f"argument {i + 1} (updated in place)")
        return
    assert_matches(got, want, what=what, dtype=dtype)


def check_ops(provider: Any, device: Any, *, dtypes: Iterable[torch.dtype] | None = None,
              ops: Iterable[str] | None = None) -> list[tuple[str, torch.dtype]]:
    """Check every supported op in every dtype the device supports; returns what was checked."""
    if dtypes is None:
        dtypes = [d for d in TOLERANCES if d in device.supported_dtypes()]
    checked = []
    for op in ops if ops is not None else OP_SPECS:
        if not provider.supports(op):
            continue
        for dtype in dtypes:
            for seed in range(OP_SPECS[op].variants if op in OP_SPECS else 1):
                check_op(provider, op, dtype, device.torch_device, seed=seed)
            checked.append((op, dtype))
    return checked
