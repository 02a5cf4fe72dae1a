"""benchmarks/grad_reduce_overlap.py in a tiny mode: with --overlap-grad-reduce the first
buckets' reductions are launched before the backward's last op (their hooks' timestamps
against the first layer's weight gradient, the last one autograd makes); the report parses."""
import re
import subprocess
import sys

import pytest

from gpt2_runs import REPO


@pytest.mark.slow
def test_buckets_are_reduced_while_the_backward_runs():
    out = subprocess.run([sys.executable, "benchmarks/grad_reduce_overlap.py", "--layers", "6",
                          "--width", "256", "--steps", "3", "--warmup", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("command: python benchmarks/grad_reduce_overlap.py")
    assert "machine: " in out.stdout
    result = dict(re.findall(r"(\w+)=([0-9.]+)", out.stdout.split("RESULT")[-1]))
    values = {k: float(v) for k, v in result.items()}
    assert values["buckets"] == 3, out.stdout
    assert values["first_launch_ms"] < values["last_grad_ms"], out.stdout
    assert values["launched_before"] >= 2, out.stdout  # all but perhaps the first layer's
