"""The GPU device check's CPU dry run: every step of benchmarks/gpu_check.sh runs and passes on CPU, small."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import service_env

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)  # slow on a busy machine: it starts two stacks and loads the model several times
def test_gpu_check_dry_run_on_cpu(tmp_path):
    env = {**service_env(), "DEVICE": "cpu", "QUICK": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)  # the script's own pytest run decides, as on the GPU machine
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    failed = [s for s in summary["steps"] if not s["ok"]]
    assert proc.returncode == 0 and summary["ok"], (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    names = {s["step"] for s in summary["steps"]}
    assert {"tests", "engine-fp32-exact", "disaggregated-exact", "engine-throughput", "served-disagg-c2"} <= names
    served = json.loads(next(s["detail"] for s in summary["steps"] if s["step"] == "disaggregated-exact"))
    assert served["exact"] and served["requests"] == 4
    assert [r["batch"] for r in summary["engine_throughput"]["rows"]] == [1, 4]
    assert all(b["failed"] == 0 for b in summary["served"]) and len(summary["served"]) == 1
    assert os.path.exists(tmp_path / "device.txt")


def test_random_weight_twin_loads_and_matches_transformers(tiny_model_dir, tmp_path):
    """What the device check runs when the built-in model cannot travel: config and tokenizer exported, random
    weights built from them; the engine's greedy tokens equal transformers' on it."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.benchmarks.device_parity import engine_greedy, hf_greedy
    from pdserve.benchmarks.random_model import build, export_config

    export_config(tiny_model_dir, tmp_path / "shipped")
    assert not list((tmp_path / "shipped").glob("*.safetensors"))
    twin = build(tmp_path / "shipped", tmp_path / "twin")
    hf = AutoModelForCausalLM.from_pretrained(str(twin), dtype=torch.float32).eval()
    batch = [[5, 17, 99, 3, 42], [7, 8, 9]]
    assert engine_greedy(str(twin), "cpu", "float32", "torch", batch, 8) == [hf_greedy(hf, p, 8) for p in batch]
