"""The version matrix: which torch, xpytorch build, kernel libraries, runtime and collective library go together.

The vendor publishes no compatibility matrix. What is known is two
deployments seen in the field, and the rules here say no more than they do:

- **vLLM-Kunlun** (0.11 – 0.15): torch 2.5.1 with the xpytorch build for torch
  2.5.1 (``xpytorch-…-torch251``), ``kunlun_ops`` 0.1.58 or later, XRE
  (the XPU runtime) 5.x;
- **sglang-kunlun** (SGLang 0.5.x): torch 2.9 with xpytorch 3.6.x,
  ``xspeedgate_ops`` builds tagged ``torch29`` (``1.2.0+680bed9.torch29``),
  XCCL 3.1.x (3.1.8.1), XRE 5.x (5.19).

Each rule is a pair — *when* component A's version is in one range,
component B's must be in another — and carries where it comes from
(:attr:`PairRule.evidence`). A mismatch names the pair, both versions and the
evidence, e.g. ``torch 2.5.1 needs kunlun_ops >=0.1.58, found kunlun_ops
0.1.40 (observed in vendor deployments: vLLM-Kunlun's install guide …)``. A
rule whose components' versions are unknown is reported unchecked, never
guessed.

Versions compare by their leading numeric parts (``5.0.21.26``,
``2.5.1+cu124`` → ``(2, 5, 1)``), since vendor version strings are not all
PEP 440. A range clause ``+torch29`` asks for that label in the version's
local part (``1.2.0+680bed9.torch29``): it is how the vendor names the torch
a kernel build is for.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Mapping

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq,
        "!=": operator.ne}
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)\s*$")
_LABEL = re.compile(r"^\s*\+([A-Za-z0-9_]+)\s*$")

OBSERVED = "observed in vendor deployments"
VLLM_KUNLUN = (f"{OBSERVED}: vLLM-Kunlun 0.11-0.15 installs torch 2.5.1, the xpytorch build for torch 2.5.1 and "
               f"kunlun_ops 0.1.58, on XRE 5.x; not a published matrix")
SGLANG_KUNLUN = (f"{OBSERVED}: sglang-kunlun installs torch 2.9 with xpytorch 3.6.x, xspeedgate_ops builds tagged "
                 f"torch29, XCCL 3.1.x, on XRE 5.x; not a published matrix")
THIS_PROJECT = "kunlun_infer is tested on torch 2.5 and later (README, 'Torch versions')"


def version_tuple(version: str) -> tuple[int, ...]:
    """Leading numeric parts of ``version``: ``"2.5.1+cu124"`` → ``(2, 5, 1)``; ValueError when none."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if match is None:
        raise ValueError(f"version {version!r} does not start with a number")
    return tuple(int(p) for p in match.group(1).split("."))


def local_labels(version: str) -> list[str]:
    """The parts of ``version``'s local segment: ``"1.2.0+680bed9.torch29"`` → ``["680bed9", "torch29"]``."""
    _, plus, local = str(version).partition("+")
    return [part for part in re.split(r"[._-]", local) if part] if plus else []


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


def in_range(version: str, spec: str) -> bool:
    """True when ``version`` satisfies every comma-separated clause of ``spec`` (``">=5.0,<6"``, ``"+torch29"``)."""
    have = version_tuple(version)
    for clause in spec.split(","):
        label = _LABEL.match(clause)
        if label is not None:
            if label.group(1) not in local_labels(version):
                return False
            continue
        match = _CLAUSE.match(clause)
        if match is None:
            raise ValueError(f"malformed version range {spec!r}: expected clauses such as '>=5.0,<6' or '+torch29'")
        left, right = _padded(have, version_tuple(match.group(2)))
        if not _OPS[match.group(1)](left, right):
            return False
    return True


@dataclasses.dataclass(frozen=True)
class PairRule:
    """When ``subject`` is in ``subject_range``, ``other`` must be in ``other_range``; ``evidence`` says why."""

    subject: str
    subject_range: str
    other: str
    other_range: str
    evidence: str = ""


#: the components, in the order a message lists them
COMPONENTS = ("torch", "xpytorch", "kunlun_ops", "xspeedgate_ops", "cocopod", "driver", "runtime", "xccl",
              "kunlun-infer-kunlun")

#: what the two observed deployments and this project's own tests support (see the module docstring)
MATRIX: tuple[PairRule, ...] = (
    PairRule("kunlun-infer-kunlun", ">=0.1", "torch", ">=2.5", THIS_PROJECT),
    PairRule("torch", ">=2.5,<2.6", "kunlun_ops", ">=0.1.58", VLLM_KUNLUN),
    PairRule("torch", ">=2.5,<2.6", "runtime", ">=5,<6", VLLM_KUNLUN),
    PairRule("torch", ">=2.9,<2.10", "xpytorch", ">=3.6,<3.7", SGLANG_KUNLUN),
    PairRule("torch", ">=2.9,<2.10", "xspeedgate_ops", "+torch29", SGLANG_KUNLUN),
    PairRule("torch", ">=2.9,<2.10", "xccl", ">=3.1,<3.2", SGLANG_KUNLUN),
    PairRule("torch", ">=2.9,<2.10", "runtime", ">=5,<6", SGLANG_KUNLUN),
)


@dataclasses.dataclass
class MatrixResult:
    """Mismatched pairs (one message each) and the rules that could not be checked."""

    mismatches: list[str]
    unchecked: list[str]

    @property
    def ok(self) -> bool:
        return not self.mismatches


def check_matrix(versions: Mapping[str, str | None], rules: tuple[PairRule, ...] = MATRIX,
                 unknown_why: Mapping[str, str] | None = None) -> MatrixResult:
    """Check ``versions`` (component → version or None) against ``rules``.

    ``unknown_why`` explains components that are unknown for a reason (shown
    in the unchecked note).
    """
    unknown_why = unknown_why or {}
    mismatches: list[str] = []
    unchecked: list[str] = []
    for rule in rules:
        subject, other = versions.get(rule.subject), versions.get(rule.other)
        label = f"{rule.subject} {rule.subject_range} / {rule.other} {rule.other_range}"
        if subject is None or other is None:
            missing = [name + (f": {unknown_why[name]}" if name in unknown_why else "")
                       for name, v in ((rule.subject, subject), (rule.other, other)) if v is None]
            unchecked.append(f"{label} (unknown: {', '.join(missing)})")
            continue
        try:
            applies = in_range(subject, rule.subject_range)
            fits = in_range(other, rule.other_range)
        except ValueError as exc:
            unchecked.append(f"{label} ({exc})")
            continue
        if applies and not fits:
            reason = f" ({rule.evidence})" if rule.evidence else ""
            mismatches.append(f"{rule.subject} {subject} needs {rule.other} {rule.other_range}, found "
                              f"{rule.other} {other}{reason}")
    return MatrixResult(mismatches=mismatches, unchecked=unchecked)
