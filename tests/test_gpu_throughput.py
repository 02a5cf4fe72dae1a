"""benchmarks/gpu_throughput.py runs end to end (tiny sizes on the CPU): every case times
a real step and the report's ratios are finite. No absolute CPU time is quoted anywhere."""
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_tiny_run_reports_every_case(tmp_path):
    png = tmp_path / "throughput.png"
    result = subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--tiny",
                             "--no-compile", "--plot", str(png)], cwd=REPO,
                            capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the tables drawn
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| case", "| ---"))]
    labels = [r[0].strip() for r in rows]
    for expected in ("megatron eager", "plain eager", "megatron deepspeed", "hf-t5 eager"):
        assert expected in labels, result.stdout
    for row in rows:
        ms, ratio = float(row[1]), float(row[6])
        assert ms > 0 and math.isfinite(ratio) and ratio > 0, row
