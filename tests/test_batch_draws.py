"""A batch function's random draws (megatron/training/batch_draws.py): seeded by the batch's
place in the run, the same wherever it is called (every stage) and at another data-parallel
size, restored after the call (tests/test_bert_example.py: pipelines equal to serial)."""
import torch

from megatron.training.batch_draws import SeededBatchFn, draw_seed


def _masking(raw):
    """A batch function that draws, as a masked-LM collator does."""
    return torch.rand(4) < 0.5, torch.randint(0, 100, (3,))


def _draws(fn, phase, iteration, micro_batches):
    fn.at(phase, iteration)
    out = []
    for m in micro_batches:
        with fn.micro_batch(m):
            out.append(fn(None))
    return out


def _equal(a, b):
    return all(torch.equal(x, y) for pair_a, pair_b in zip(a, b) for x, y in zip(pair_a, pair_b))


def test_draws_follow_the_place_in_the_run_not_the_caller(seed):
    first, last = SeededBatchFn(_masking, seed), SeededBatchFn(_masking, seed)
    torch.rand(7)  # another stage's generator is elsewhere: it does not matter
    assert _equal(_draws(first, "train", 3, range(4)), _draws(last, "train", 3, range(4)))
    assert not _equal(_draws(first, "train", 3, [0]), _draws(first, "train", 4, [0]))
    assert not _equal(_draws(first, "train", 3, [0]), _draws(first, "valid", 3, [0]))
    assert not _equal(_draws(first, "train", 3, [0]), _draws(first, "train", 3, [1]))
    assert not _equal(_draws(first, "train", 3, [0]),
                      _draws(SeededBatchFn(_masking, seed + 1), "train", 3, [0]))
    # a caller that does not say which micro-batch: calls in order since at()
    first.at("train", 3)
    assert _equal([first(None), first(None)], _draws(last, "train", 3, [0, 1]))


def test_a_data_parallel_rank_draws_what_serial_draws_for_the_same_samples(seed):
    """dp 2: micro-batch m of rank r holds the samples serial reads as micro-batch 2m + r."""
    serial = _draws(SeededBatchFn(_masking, seed), "train", 5, range(4))
    for rank in (0, 1):
        mine = _draws(SeededBatchFn(_masking, seed, dp_rank=rank, dp_size=2), "train", 5,
                      range(2))
        assert _equal(mine, [serial[2 * m + rank] for m in range(2)])


def test_generators_are_restored_and_seeds_are_stable(seed):
    torch.manual_seed(seed)
    expected = torch.rand(5)
    torch.manual_seed(seed)
    _draws(SeededBatchFn(_masking, seed), "train", 0, range(3))
    assert torch.equal(torch.rand(5), expected)  # the model's own draws go on as before
    assert draw_seed(1234, "train", 0, 0, 1) == draw_seed(1234, "train", 0, 0, 1) < 2 ** 63
