"""Shared pytest fixtures: fresh random seeds, printed so a failure can be replayed."""
import os
import random

import pytest


@pytest.fixture
def seed(request):
    """A fresh seed per test (``MEGATRON_TEST_SEED`` pins it), shown in the test report."""
    value = int(os.environ.get("MEGATRON_TEST_SEED") or random.SystemRandom().randrange(2**31))
    request.node.user_properties.append(("seed", value))
    print(f"seed={value} (rerun with MEGATRON_TEST_SEED={value})")
    return value
