#!/usr/bin/env python3
"""Check the torch range: for each torch release, does ``pip install`` keep it, and do the core tests pass on it?

For every release asked for (default: the README's table), a virtual
environment with that torch from the package registry, then this checkout
installed into it with its test extra the way a user with a vendor's torch
would (``pip install -e ".[test]"``, which must leave that torch alone), then
the core tests: engine and model parity against transformers (eager and from captured steps), tensor
parallelism on gloo, the conformance suite on the built-in plugins, the plugin
runtime, a plugin distribution end to end, and the Kunlun plugin (whose
stacks ship torch 2.5.1 and 2.9). It prints one Markdown row per release and
exits non-zero when any release fails.

The environments are kept under ``--venvs`` (default
``~/.cache/kunlun_infer/torch-venvs``), one per release, keyed by everything
that decides what gets installed (the release, the Python version, the
project's and the plugins' ``pyproject.toml``): a later run with the same key
only re-points the project at this checkout (``--no-deps``), so nothing is
downloaded again. torch releases on the registry for Linux are CUDA builds
with their ``nvidia-*`` libraries (about 3-5 GB per release); they run on a
CPU. Uses only the standard library, so any ``python3`` can run it:

    python3 scripts/check_torch_versions.py                # every release in the README's table
    python3 scripts/check_torch_versions.py 2.5.1 2.11.0   # these
    python3 scripts/check_torch_versions.py --oldest       # the lower bound only (what CI runs)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the releases of the README's table, oldest first; the first is pyproject's lower bound
RELEASES = ("2.5.1", "2.9.1", "2.11.0", "2.13.0+cpu")
#: the core tests (paths relative to the checkout)
CORE_TESTS = (
    "tests/engine/test_correctness.py",
    "tests/engine/test_penalties.py",
    "tests/engine/test_sampler.py",
    "tests/engine/test_step_graphs.py",
    "tests/models/test_model_logits.py",
    "tests/models/test_rope_scaling.py",
    "tests/models/test_tensor_parallel.py",
    "tests/plugins/test_builtin_conformance.py",
    "tests/plugins/test_cpu_capture.py",
    "tests/runtime",
    "tests/hooks/test_simchip_engine.py",
    "hooks/kunlun-infer-kunlun/tests",
)
DEFAULT_VENVS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kunlun_infer" / "torch-venvs"
_SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed).*?) in [0-9.]+s", re.MULTILINE)


def extra_requirements(release: str) -> list[str]:
    """What a release needs beside the test extra: transformers 5 disables itself below torch 2.6."""
    major, minor = (int(p) for p in release.split(".")[:2])
    return ["transformers>=4.50,<5"] if (major, minor) < (2, 6) else []


def venv_key(release: str) -> str:
    """A hash of everything that decides what a release's environment holds."""
    digest = hashlib.sha256(f"{release}|{sys.version_info[:2]}|{extra_requirements(release)}".encode())
    for pyproject in sorted([ROOT / "pyproject.toml", *ROOT.glob("hooks/*/pyproject.toml")]):
        digest.update(pyproject.read_bytes())
    return digest.hexdigest()[:12]


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, text=True, capture_output=True, **kwargs)


def torch_version(python: Path) -> str:
    done = run([str(python), "-c", "import torch; print(torch.__version__)"])
    return done.stdout.strip() if done.returncode == 0 else f"(import failed: {done.stderr.strip()[-200:]})"


def pip(python: Path, *args: str) -> None:
    done = run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args])
    if done.returncode != 0:
        tail = "\n".join(line for line in done.stderr.splitlines() if "WARNING: Location" not in line)[-2000:]
        raise RuntimeError(f"pip install {' '.join(args)} failed:\n{tail}")


def prepare(release: str, venvs: Path, log) -> tuple[Path, str]:
    """The release's environment with this checkout installed; ``(python, how pip treated torch)``."""
    venv = venvs / f"torch-{release}-{venv_key(release)}"
    python = venv / "bin" / "python"
    hooks = sorted(str(p) for p in ROOT.glob("hooks/*") if (p / "pyproject.toml").exists())
    if (venv / ".ready").exists():
        log(f"torch {release}: reusing {venv}")
        pip(python, "--no-deps", "--no-build-isolation", "-e", ".", *[arg for h in hooks for arg in ("-e", h)])
        return python, "kept (cached environment)"
    log(f"torch {release}: building {venv} (downloads torch from the package registry)")
    for stale in venvs.glob(f"torch-{release}-*"):  # older builds of this release (3-5 GB each) go
        shutil.rmtree(stale, ignore_errors=True)
    venvs.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip(python, f"torch=={release}", "setuptools>=77", "wheel")
    before = torch_version(python)
    pip(python, "-e", ".[test]", *extra_requirements(release))  # as a user with a vendor's torch would
    pip(python, *[arg for h in hooks for arg in ("-e", h)])
    after = torch_version(python)
    if after != before:
        raise RuntimeError(f"pip install -e .[test] replaced torch {before} with {after}")
    (venv / ".ready").write_text(json.dumps({"torch": after, "built": time.strftime("%Y-%m-%dT%H:%M:%S")}))
    return python, f"kept {after}"


def check(release: str, venvs: Path, log) -> dict:
    started = time.monotonic()
    row = {"release": release, "pip": "-", "torch": "-", "tests": "-", "ok": False}
    try:
        python, row["pip"] = prepare(release, venvs, log)
        row["torch"] = torch_version(python)
        log(f"torch {release}: core tests ({' '.join(CORE_TESTS)})")
        done = run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *CORE_TESTS],
                   env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        found = _SUMMARY.findall(done.stdout)
        row["tests"] = found[-1] if found else f"pytest exit {done.returncode}"
        row["ok"] = done.returncode == 0
        if not row["ok"]:
            log(done.stdout[-4000:])
            if done.stderr.strip():  # a crash's traceback of every thread (pytest's faulthandler) lands here
                log(f"stderr of the core tests on torch {release}:\n{done.stderr[-6000:]}")
    except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
        row["tests"] = f"not run: {exc}".splitlines()[0]
        log(str(exc))
    row["seconds"] = round(time.monotonic() - started)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="*", help=f"torch releases (default: {' '.join(RELEASES)})")
    parser.add_argument("--oldest", action="store_true", help=f"only the lower bound, {RELEASES[0]}")
    parser.add_argument("--venvs", type=Path, default=DEFAULT_VENVS, help=f"where the environments live "
                                                                          f"(default {DEFAULT_VENVS})")
    args = parser.parse_args(argv)
    releases = [RELEASES[0]] if args.oldest else (args.releases or list(RELEASES))

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    rows = [check(release, args.venvs.expanduser(), log) for release in releases]
    print("| torch | `pip install -e .[test]` | core tests | time |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['torch'] if r['torch'] != '-' else r['release']} | {r['pip']} | {r['tests']} | "
              f"{r['seconds']} s |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
