"""Batches read ahead on a background thread: same order, errors surface, the thread stops."""
import threading
import time

import pytest

from gpt2_runs import gpt2_argv, train_gpt2
from harness import run_distributed
from megatron.data.prefetch import Prefetcher


def test_items_come_in_order_from_another_thread(seed):
    readers = []

    def source():
        for i in range(seed % 50 + 20):
            readers.append(threading.current_thread().name)
            yield i

    assert list(Prefetcher(source(), depth=3)) == list(range(seed % 50 + 20))
    assert set(readers) == {"megatron-prefetch"}


def test_reads_at_most_depth_ahead_and_close_stops_the_thread():
    produced = []

    def source():
        for i in range(1000):
            produced.append(i)
            yield i

    prefetcher = Prefetcher(source(), depth=2)
    assert next(prefetcher) == 0
    time.sleep(0.3)
    assert len(produced) <= 1 + 2 + 1  # the one taken, two queued, one waiting to be put
    prefetcher.close()
    assert not prefetcher._thread.is_alive()


def test_an_error_in_the_reader_is_raised_on_the_training_thread():
    def source():
        yield 1
        raise ValueError("corrupt sample 7")

    prefetcher = Prefetcher(source())
    assert next(prefetcher) == 1
    with pytest.raises(ValueError, match="corrupt sample 7"):
        next(prefetcher)


def test_training_reads_the_same_batches_with_and_without_prefetching(gpt2_data):
    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "4", "--log-interval",
                     "1", "--hidden-dropout", "0", "--attention-dropout", "0")
    (ahead, _), = run_distributed(train_gpt2, 1, argv)
    (inline, _), = run_distributed(train_gpt2, 1, argv + ["--prefetch-batches", "0"])
    assert ahead == inline and len(ahead) == 4
