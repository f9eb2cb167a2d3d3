"""recipes/gpu_check.py on a machine without a GPU: it says what it skipped and why, and still trains a team."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "recipes" / "gpu_check.py"


@pytest.mark.slow
def test_gpu_check_reports_skipped_gpu_checks_and_a_team_that_trains_on_the_cpu(default_model_dir, tmp_path):
    report_path = tmp_path / "report.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(report_path)], capture_output=True, text=True, env=env, timeout=900
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "All checks that could run passed." in run.stdout
    report = json.loads(report_path.read_text())
    checks = {check["name"]: check for check in report["checks"]}
    assert report["device"] == "cpu"
    for name in ("device", "bitsandbytes 4-bit on CUDA", "memory plan"):
        assert checks[name]["status"] == "skipped" and "no CUDA GPU" in checks[name]["detail"], checks[name]
    assert "predicted peak" in checks["memory plan"]["detail"]  # the planner ran; only the comparison was skipped
    assert checks["precision"]["status"] == "ok" and "float32" in checks["precision"]["detail"]
    assert checks["decode step"]["status"] == "ok", checks["decode step"]
    assert report["decode"]["path"] == "eager generate" and report["decode"]["equal"] is True  # the CPU default
    assert (
        report["decode"]["equal_rows"] == 8 and "greedy tokens equal in 8 of 8 rows" in checks["decode step"]["detail"]
    )
    assert report["decode"]["eager_ms"] > 0 and report["decode"]["captured_ms"] > 0
    assert checks["team training"]["status"] == "ok"
    assert report["training"]["adapters_moved"] == {"concise": True, "detailed": True}
    assert len(report["training"]["step_seconds"]) == 2
