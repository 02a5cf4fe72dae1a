"""benchmarks/host_overhead.py in a tiny mode: it runs both models, and its report parses."""
import re
import subprocess
import sys

import pytest

from gpt2_runs import REPO


@pytest.mark.slow
@pytest.mark.exhaustive  # a benchmark's smoke run (~20 s)
def test_host_overhead_reports_times_ops_and_syncs(gpt2_data, t5_data):
    out = subprocess.run(
        [sys.executable, "benchmarks/host_overhead.py", "--steps", "2", "--warmup", "1",
         "--count-steps", "1", "--runs", "1", "--micro-batch", "2", "--gas", "2",
         "--gpt2-data", gpt2_data["prefix"], gpt2_data["vocab"], gpt2_data["merges"],
         "--t5-data", t5_data["prefix"], t5_data["spm"]],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("command: python benchmarks/host_overhead.py")
    assert "machine: " in out.stdout
    results = dict(re.findall(r"^RESULT (\w+) (.*)$", out.stdout, re.M))
    assert set(results) == {"gpt2", "t5"}, out.stdout
    for model, line in results.items():
        values = {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", line)}
        assert values["ms_ratio"] > 0 and values["cpu_ratio"] > 0, (model, line)
        assert values["ops_megatron"] > 0, (model, line)
        assert values["ops_plain"] > 0, (model, line)
        # the plain loops read their loss every step; the pretrain() step reads nothing
        assert values["syncs_plain"] >= 1 and values["syncs_megatron"] == 0, (model, line)
