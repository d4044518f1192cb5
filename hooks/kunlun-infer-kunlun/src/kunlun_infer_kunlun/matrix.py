"""The version matrix: which driver, runtime, collective library, ``torch_xmlir`` and plugin go together.

The matrix is a list of pair rules: *when* component A's version is in one
range, component B's must be in another. Checking it names each mismatched
pair with both versions and what A needs, e.g. ``torch_xmlir 2.1.0 needs
driver >=5.0, found driver 4.0.3``. A rule whose components' versions are
unknown is skipped and reported as unchecked, never guessed.

Versions are compared by their leading numeric parts (``5.0.21.26``,
``2.1.0+xpu`` → ``(2, 1, 0)``), since vendor version strings are not all PEP 440.

The bounds in :data:`MATRIX` are this plugin's assumptions, written without
access to a Kunlun card or to the vendor's release matrix; they are data, to
be corrected from the vendor's release notes (see the README).
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Mapping

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq,
        "!=": operator.ne}
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)\s*$")


def version_tuple(version: str) -> tuple[int, ...]:
    """Leading numeric parts of ``version``: ``"2.1.0+xpu"`` → ``(2, 1, 0)``; ValueError when none."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if match is None:
        raise ValueError(f"version {version!r} does not start with a number")
    return tuple(int(p) for p in match.group(1).split("."))


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


def in_range(version: str, spec: str) -> bool:
    """True when ``version`` satisfies every comma-separated clause of ``spec`` (``">=5.0,<6"``)."""
    have = version_tuple(version)
    for clause in spec.split(","):
        match = _CLAUSE.match(clause)
        if match is None:
            raise ValueError(f"malformed version range {spec!r}: expected clauses such as '>=5.0,<6'")
        left, right = _padded(have, version_tuple(match.group(2)))
        if not _OPS[match.group(1)](left, right):
            return False
    return True


@dataclasses.dataclass(frozen=True)
class PairRule:
    """When ``subject`` is in ``subject_range``, ``other`` must be in ``other_range``."""

    subject: str
    subject_range: str
    other: str
    other_range: str
    why: str = ""


#: the components, in the order a message lists them
COMPONENTS = ("driver", "runtime", "bkcl", "torch_xmlir", "kunlun-infer-kunlun")

#: this plugin's compatibility assumptions (unverified on hardware; see the module docstring)
MATRIX: tuple[PairRule, ...] = (
    PairRule("kunlun-infer-kunlun", ">=0.1,<0.2", "torch_xmlir", ">=2.0",
             "the plugin uses the CUDA-API device and the nccl process-group backend of torch_xmlir 2.x"),
    PairRule("torch_xmlir", ">=2.0", "runtime", ">=5.0", "torch_xmlir 2.x is built against the XPU runtime 5.x"),
    PairRule("torch_xmlir", ">=2.0", "driver", ">=5.0", "P800 (XPU3) support starts with driver 5.x"),
    PairRule("runtime", ">=5.0", "driver", ">=5.0", "the runtime needs a driver of at least its own major version"),
    PairRule("torch_xmlir", ">=2.0", "bkcl", ">=2.0", "torch_xmlir 2.x loads the 2.x collective library"),
)


@dataclasses.dataclass
class MatrixResult:
    """Mismatched pairs (one message each) and the rules that could not be checked."""

    mismatches: list[str]
    unchecked: list[str]

    @property
    def ok(self) -> bool:
        return not self.mismatches


def check_matrix(versions: Mapping[str, str | None], rules: tuple[PairRule, ...] = MATRIX) -> MatrixResult:
    """Check ``versions`` (component → version or None) against ``rules``."""
    mismatches: list[str] = []
    unchecked: list[str] = []
    for rule in rules:
        subject, other = versions.get(rule.subject), versions.get(rule.other)
        label = f"{rule.subject} {rule.subject_range} / {rule.other} {rule.other_range}"
        if subject is None or other is None:
            missing = [name for name, v in ((rule.subject, subject), (rule.other, other)) if v is None]
            unchecked.append(f"{label} (unknown: {', '.join(missing)})")
            continue
        try:
            applies = in_range(subject, rule.subject_range)
            fits = in_range(other, rule.other_range)
        except ValueError as exc:
            unchecked.append(f"{label} ({exc})")
            continue
        if applies and not fits:
            reason = f" ({rule.why})" if rule.why else ""
            mismatches.append(f"{rule.subject} {subject} needs {rule.other} {rule.other_range}, found "
                              f"{rule.other} {other}{reason}")
    return MatrixResult(mismatches=mismatches, unchecked=unchecked)
