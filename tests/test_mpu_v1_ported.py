"""Megatron v1.0's own mpu tests (tests/megatron_v1_mpu/, ported by their imports: ``import
mpu`` became ``from megatron.mpu import v1 as mpu``, ``from mpu import layers`` became ``from
megatron.mpu.v1 import layers``, ...) pass, each run as v1.0 ran it: its ``__main__`` on 4
ranks, every model-parallel size 1, 2, 4. (v1.0's BERT-only attention tests aside.)
"""
import os
import runpy
import sys

import pytest

from harness import run_distributed

PORTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_v1_mpu")


def _run_script(name):
    """Rank body: run the ported script as ``__main__``, with its folder on the path (for
    ``from commons import ...``, as in v1.0)."""
    sys.path.insert(0, PORTED)
    runpy.run_path(os.path.join(PORTED, f"{name}.py"), run_name="__main__")
    return True


@pytest.mark.parametrize("name", ["test_initialize", "test_data", "test_random",
                                  "test_cross_entropy", "test_layers"])
def test_megatron_v1_mpu_test_passes(name):
    assert run_distributed(_run_script, 4, name, timeout=240) == [True] * 4
