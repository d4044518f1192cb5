"""examples/plugin_from_scratch, start to finish: pip-install it, see it listed, vet it with the
conformance suite, and compose runs with it — alone and mixed with simchip."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.hooks.conftest import MAX_TOKENS, overrides

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin_from_scratch"

# one interpreter for the listing and both runs: each start-up imports torch
RUN_SCRIPT = """
import io, json, sys
import kunlun_infer as ki
from kunlun_infer.cli import main

listing = io.StringIO()
assert main(["plugins", "--json"], stdout=listing) == 0
results = {"listing": json.loads(listing.getvalue())}
model, runs, prompts, max_tokens = json.loads(sys.argv[1])
for label, overrides in runs.items():
    with ki.LLM(model=model, overrides=overrides) as llm:
        outs = llm.generate(prompts, ki.SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
        runtime = llm.engine.runtime
        results[label] = {"tokens": [o.token_ids for o in outs], "memory": runtime.plugin_for("memory"),
                          "device": runtime.plugin_for("device"), "ledger": runtime.memory.ledger()}
print(json.dumps(results))
"""


def run(argv, env, **kwargs):
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, **kwargs)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_plugin_from_scratch_start_to_finish(tmp_path, llama_dir, prompts, references):
    source = tmp_path / "plugin_from_scratch"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
         "--target", str(site), str(source)], dict(os.environ))
    assert (site / "kunlun_infer_ledger_memory-1.0.0.dist-info").is_dir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    env.pop("KUNLUN_INFER_PLUGINS", None)

    # vetted by the framework's conformance suite (the example's own test module)
    report = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(source / "tests")], env,
                 cwd=tmp_path)
    assert "4 passed" in report

    runs = {"alone": overrides("memory=ledger"),
            "mixed": overrides("device=simchip", "memory=ledger", "ops=simchip", "device.capacity=64MiB")}
    results = json.loads(run([sys.executable, "-c", RUN_SCRIPT, json.dumps(
        [str(llama_dir), runs, prompts, MAX_TOKENS])], env).splitlines()[-1])

    # listed by the CLI, from its distribution, through the entry point
    row = next(p for p in results["listing"]["plugins"] if p["name"] == "ledger")
    assert row["distribution"] == "kunlun-infer-ledger-memory" and row["version"] == "1.0.0"
    assert row["options"] == {"memory": ["ledger"]} and row["error"] is None

    # a run composed with it gives transformers' tokens, every KV tensor on its ledger
    alone = results["alone"]
    assert alone["tokens"] == references and alone["memory"] == "ledger" and alone["device"] == "cpu"
    assert len(alone["ledger"]) == 4 and all(n % 256 == 0 for n in alone["ledger"])  # K and V of 2 layers

    # and it mixes with another distribution's device and ops: simchip + ledger memory
    mixed = results["mixed"]
    assert mixed["tokens"] == references and (mixed["device"], mixed["memory"]) == ("simchip", "ledger")
