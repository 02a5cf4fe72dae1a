"""The multi-rank harness itself: results, surfaced tracebacks, crashes and hangs."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import DistributedTestFailure, run_distributed


def _sum_of_ranks(offset):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.environ["RANK"]


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()  # rank 0 would wait forever: the harness must stop it


def _exit_hard():
    if dist.get_rank() == 1:
        os._exit(3)
    return "fine"


def _hang():
    print("about to sleep", flush=True)
    time.sleep(600)


@pytest.mark.parametrize("world_size", [1, 3])
def test_results_come_back_in_rank_order(world_size):
    results = run_distributed(_sum_of_ranks, world_size, 10)
    total = sum(range(world_size)) + 10 * world_size
    assert results == [(r, world_size, float(total), str(r)) for r in range(world_size)]


def test_a_rank_traceback_is_in_the_failure():
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_raise_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert "rank 1 raised" in message and "rank one is unhappy" in message
    assert "_raise_on_rank_one" in message


def test_a_crashed_rank_is_reported():
    with pytest.raises(DistributedTestFailure, match="rank 1 exited with code 3"):
        run_distributed(_exit_hard, 2, timeout=60)


def test_a_hang_times_out_with_stacks():
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as info:
        run_distributed(_hang, 2, timeout=3)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "timed out after 3s" in message
    assert "about to sleep" in message and "_hang" in message  # faulthandler stack dump
