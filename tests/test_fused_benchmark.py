"""The kernel benchmark runs end to end (tiny shapes, no torch.compile) and reports targets."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    out = tmp_path / "kernels.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "kernels.py"), "--device", "cpu",
           "--seqs", "64", "--hiddens", "256", "--rows", "64", "--repeats", "2", "--no-compile",
           "--json", str(out), "--plot", str(tmp_path / "kernels.png")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "command: python" in run.stdout and "machine:" in run.stdout
    assert "targets:" in run.stdout
    results = json.loads(out.read_text())["results"]
    ops = {(r["op"], r["direction"], r["impl"]) for r in results}
    for op, direction in [("causal", "fwd"), ("causal", "bwd"), ("padding", "fwd"),
                          ("padding", "bwd"), ("layer_norm", "fwd"), ("layer_norm", "fwd+bwd")]:
        assert {(op, direction, "fused"), (op, direction, "eager")} <= ops
    assert all(r["vs_eager"] > 0 for r in results)
    png = (tmp_path / "kernels.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
