"""Check that ``pip install .`` (not editable) composes the same config as the checkout.

``conf/`` sits at the top level of the repository and is mapped into the
package as ``kunlun_infer.conf`` at build time. This script installs the
checkout into a fresh venv the way a user would, then compares, against the
checkout's own environment (the interpreter running this script, with the
checkout installed editable):

* the files of the installed ``kunlun_infer.conf`` with the checkout's ``conf/``;
* ``kunlun-infer config --json`` for a few override sets (built-in plugins only,
  since the fresh venv has only the package itself).

Usage (from the repository root, with the project's venv active)::

    python scripts/check_installed_config.py [--keep DIR]

Exits 0 when everything matches, 1 with the differences otherwise. It takes a
few minutes (a venv, torch and the other dependencies are installed), which
is why it is a script and not part of the test suite; the suite's
``tests/test_config_tree.py`` checks the editable side and the package list.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OVERRIDE_SETS = ([], ["deploy=cpu"], ["memory=simple", "scheduler=latency"], ["comm=gloo", "parallel.tensor_size=2"])

LIST_CONF = """
import importlib.resources, json
def walk(node, prefix=""):
    for entry in node.iterdir():
        if entry.is_dir():
            if entry.name != "__pycache__":
                yield from walk(entry, prefix + entry.name + "/")
        elif entry.name.endswith((".yaml", ".py")):
            yield prefix + entry.name, entry.read_text()
print(json.dumps(dict(walk(importlib.resources.files("kunlun_infer.conf")))))
"""


def run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tempfile.gettempdir(), check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def composed(python: str) -> dict[str, object]:
    return {" ".join(o) or "(defaults)": json.loads(run([python, "-m", "kunlun_infer", "config", "--json", *o]))
            for o in OVERRIDE_SETS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="build the venv here and keep it (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kunlun-installed-") as scratch:
        where = args.keep or Path(scratch) / "venv"
        print(f"fresh venv in {where}", flush=True)
        venv.create(where, with_pip=True)
        python = str(where / "bin" / "python")
        print("pip install . (not editable)", flush=True)
        run([python, "-m", "pip", "install", "-q", str(REPO)])
        location = run([python, "-c", "import kunlun_infer.conf as c; print(c.__file__)"]).strip()
        if location.startswith(str(REPO)):
            print(f"the fresh venv imports kunlun_infer.conf from the checkout ({location}), not its own install")
            return 1
        failures = []
        installed = json.loads(run([python, "-c", LIST_CONF]))
        checkout = json.loads(run([sys.executable, "-c", LIST_CONF]))
        for name in sorted(set(installed) | set(checkout)):
            if installed.get(name) != checkout.get(name):
                failures.append(f"conf/{name}: {'differs' if name in installed and name in checkout else 'missing'} "
                                f"in the {'installed package' if name not in installed else 'checkout'}")
        mine, theirs = composed(sys.executable), composed(python)
        for overrides in mine:
            if mine[overrides] != theirs[overrides]:
                failures.append(f"kunlun-infer config {overrides}: the installed package composes something else")
        print(f"{len(installed)} conf files, {len(mine)} compositions compared")
        for failure in failures:
            print("MISMATCH", failure)
        print("OK: the installed package composes the same config as the checkout" if not failures else "FAILED")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
