"""`--help` of every entry script and tool exits 0 and lists the flags that script defines."""
import glob
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["pretrain_gpt2.py", "pretrain_t5.py"] + sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "tools", "*.py")))
# Flags every training entry point must show (they come from the shared argument groups).
TRAINING_FLAGS = ["--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                  "--exit-interval", "--make-vocab-size-divisible-by", "--micro-batch-size"]


def _own_flags(script):
    """The long options a script adds itself (parsed from its source)."""
    with open(os.path.join(REPO, script)) as f:
        return set(re.findall(r"add_argument\(\s*\"(--[A-Za-z0-9-]+)\"", f.read()))


def _help(script):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, script, "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_every_entry_point_prints_help():
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(SCRIPTS, pool.map(_help, SCRIPTS)))
    for script, proc in results.items():
        assert proc.returncode == 0, (script, proc.stderr[-2000:])
        assert proc.stdout.startswith("usage:"), (script, proc.stdout[:200])
        expected = _own_flags(script) | (set(TRAINING_FLAGS) if "pretrain" in script else set())
        missing = sorted(f for f in expected if f not in proc.stdout)
        assert not missing, (script, missing)
        assert len(re.findall(r"^\s+--", proc.stdout, re.M)) >= 2, script


def test_help_strings_are_valid_format_strings():
    """argparse %-formats help strings: a bare % crashes --help (fast check, no subprocess)."""
    from megatron.config import build_parser

    text = build_parser().format_help()
    assert "iteration % this == 0" in text
