"""benchmarks/quality_gpt.py runs end to end on a tiny GPT (one gloo rank on CPU): every
recipe trains, the table has its rows, and the dense baseline's loss goes down."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quality_gpt_trains_every_recipe_on_a_tiny_gpt(tmp_path):
    out = tmp_path / "quality.md"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        str(REPO / "benchmarks" / "quality_gpt.py"),
        "--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64", "--context", "16",
        "--batch", "2", "--steps", "10", "--warmup", "3", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [
        line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line
    ]
    recipes = re.findall(
        r'^    "([a-z0-9.-]+)": \(', (REPO / "benchmarks" / "quality_gpt.py").read_text(), re.M
    )
    assert len(recipes) >= 13, recipes  # (what the pattern finds: RECIPES' keys)
    assert len(rows) == 1 + len(recipes), rows  # the header and one row per recipe
    dense = re.findall(r"[0-9]+\.[0-9]{3}", rows[1])
    first, last = float(dense[0]), float(dense[-1])
    assert last < first, rows[1]  # loss at step 10 below step 1's
    sent = [float(row.split("|")[-3]) for row in rows[2:]]
    assert all(mb > 0 for mb in sent), rows  # every compressed recipe sent something
