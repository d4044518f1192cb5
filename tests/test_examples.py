"""The embedding example runs as-is against a model folder and shows what it promises."""

import os
import subprocess
import sys
from pathlib import Path

from tests.engine.tiny_models import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_embedding_example_streams_adds_and_aborts(tmp_path):
    folder = build_tiny_model(tmp_path / "model", "llama")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_engine.py"), f"model.path={folder}",
         "model.max_model_len=256", "scheduler.max_num_seqs=4"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "== batch generation ==" in out and "'def fibonacci(n):' ->" in out
    assert "[quicksort] +" in out  # streamed pieces
    assert "[late] finished" in out
    assert "[stack] aborted by the application" in out and "[stack] finished (abort)" in out
    assert "'kv_blocks_free': 64" in out and "'kv_blocks_total': 64" in out
