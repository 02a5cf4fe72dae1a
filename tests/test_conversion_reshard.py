"""Native checkpoints across (tp, pp) layouts: key tables vs the real modules, exact round
trips, vocabulary re-padding, and the same training losses after a reshard."""
import os
import random

import pytest
import torch

from gpt2_ckpt import model_args, random_checkpoint
from gpt2_runs import gpt2_argv, train_gpt2
from harness import run_distributed
from megatron.checkpoint_conversion import (ConversionRequest, FullCheckpoint, full_keys,
                                            read_native, reshard, run_conversion,
                                            stage_spec_bounds, tp_split_dim, write_native)
from megatron.checkpoint.gpt2_keys import WORD_EMBEDDINGS, pipe_to_full_key
from megatron.checkpoint import checkpoint_name

LAYERS, HIDDEN, HEADS, VOCAB, POSITIONS = 3, 32, 4, 256, 16


def _config(seed):
    from megatron.model.transformer import TransformerConfig

    return TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             kv_channels=HIDDEN // HEADS, ffn_hidden_size=4 * HIDDEN,
                             hidden_dropout=0.0, attention_dropout=0.0, seed=seed)


def _gpt2_model_state(seed, tp):
    """Rank body: GPT2Model's state dict and each parameter's tp attributes."""
    from megatron import mpu
    from megatron.model.gpt2_model import GPT2Model

    mpu.initialize_model_parallel(tp, 1)
    model = GPT2Model(_config(seed), VOCAB, POSITIONS)
    return _numpy(model.state_dict()), _tp_attributes(model)


def _pipe_state(seed, tp, pp):
    """Rank body: this rank's GPT2ModelPipe stage state dict and tp attributes, with its ranks."""
    import tds
    from megatron import mpu
    from megatron.model.gpt2_model_pipe import GPT2ModelPipe
    from tds.pipe import PipeModelDataParallelTopology

    tds.init_distributed(dist_backend="gloo")
    mpu.initialize_model_parallel(tp, pp)
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=1)
    model = GPT2ModelPipe(_config(seed), VOCAB, POSITIONS, topology)
    ranks = (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank())
    return ranks, _numpy(model.state_dict()), _tp_attributes(model)


def _tp_attributes(model):
    return {n: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1),
                getattr(p, "partition_stride", 1)) for n, p in model.named_parameters()}


def _numpy(state):
    """Tensors by value: a tensor sent back from a rank is a shared-memory handle that dies
    with the rank process."""
    return {k: v.numpy() for k, v in state.items()}


def _torch(state):
    return {k: torch.from_numpy(v) for k, v in state.items()}


def _assert_same(a, b):
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def module_seed():
    value = int(os.environ.get("MEGATRON_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"module seed={value} (rerun with MEGATRON_TEST_SEED={value})")
    return value


@pytest.fixture(scope="module")
def built(module_seed):
    """The serial GPT2Model's state, and each rank's GPT2ModelPipe stage at (tp=2, pp=2)."""
    serial = _torch(run_distributed(_gpt2_model_state, 1, module_seed, 1)[0][0])
    ranks = run_distributed(_pipe_state, 4, module_seed, 2, 2)
    return serial, [(r, _torch(state), attrs) for r, state, attrs in ranks]


def test_split_table_matches_the_layers_attributes(built):
    serial, ranks = built
    assert list(serial) == full_keys(LAYERS)
    for _, state, attrs in ranks:
        for name, (parallel, dim, stride) in attrs.items():
            full_name = pipe_to_full_key(name, LAYERS)
            assert tp_split_dim(full_name) == (dim if parallel else None), name
            assert stride == 1, name  # per-head QKV: contiguous splits, no interleave
            expected = list(serial[full_name].shape)
            if parallel:
                expected[dim] //= 2
            assert list(state[name].shape) == expected, name


def test_pipeline_stages_match_gpt2_model_pipe(tmp_path, built):
    """Stage files written by the converter hold what GPT2ModelPipe's stages hold.

    Initialisation is layout-invariant, so the pipe model built from the same seed has
    the same tensors: the converter's split of the serial model must match them key for
    key and bit for bit, and reading the pipe modules' own state dicts back gives the
    serial model.
    """
    full, ranks = built
    tp, pp = 2, 2
    args = model_args(LAYERS, HIDDEN, HEADS, VOCAB, POSITIONS)
    written = write_native(FullCheckpoint(full, args, iteration=7), str(tmp_path / "conv"),
                           tp, pp)
    assert written.endswith("iter_0000007")
    for (tp_rank, pp_rank), state, _ in ranks:
        converted = torch.load(checkpoint_name(str(tmp_path / "conv"), 7, tp_rank, pp_rank),
                               weights_only=True)["model"]
        _assert_same(converted, state)
        path = checkpoint_name(str(tmp_path / "modules"), 7, tp_rank, pp_rank)
        os.makedirs(os.path.dirname(path))
        saved = {**args, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
        torch.save({"args": saved, "model": state, "iteration": 7}, path)
    (tmp_path / "modules" / "latest_checkpointed_iteration.txt").write_text("7")
    _assert_same(read_native(str(tmp_path / "modules")).state, full)


def test_reshard_round_trips_and_repads_the_vocabulary(tmp_path, seed):
    true_vocab = 200
    source = random_checkpoint(seed, LAYERS, HIDDEN, HEADS, true_vocab, POSITIONS)
    source.iteration, source.extras = 5, {"consumed_train_samples": 40}
    state = source.state
    # (tp, pp, divisible_by) -> padded 256, 216, 256, 200: the size changes every time
    layouts = [(2, 1, 64), (1, 3, 72), (4, 2, 64), (1, 1, 50)]
    previous = source
    for i, (tp, pp, divisible_by) in enumerate(layouts):
        target = reshard(previous, tp, pp, divisible_by=divisible_by)
        write_native(target, str(tmp_path / f"l{i}"), tp, pp)
        back = read_native(str(tmp_path / f"l{i}"))
        padded = back.args["padded_vocab_size"]
        assert padded == -(-true_vocab // (tp * divisible_by)) * tp * divisible_by
        assert back.state[WORD_EMBEDDINGS].shape[0] == padded
        assert torch.equal(back.state[WORD_EMBEDDINGS][:true_vocab], state[WORD_EMBEDDINGS])
        assert not back.state[WORD_EMBEDDINGS][true_vocab:].any()  # zero padding rows
        for key in state:
            if key != WORD_EMBEDDINGS:
                assert torch.equal(back.state[key], state[key]), (tp, pp, key)
        assert (back.iteration, back.extras) == (5, {"consumed_train_samples": 40})
        previous = back


def test_stage_bounds_give_every_layer_one_stage():
    """Every stage gets at least one layer and the stages cover the specs in order."""
    for layers in range(1, 9):
        for pp in range(1, layers + 1):
            bounds = stage_spec_bounds(layers, pp)
            assert bounds[0][0] == 0 and bounds[-1][1] == layers + 3
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            counts = [len(set(range(*b)) & set(range(1, layers + 1))) for b in bounds]
            assert sum(counts) == layers and max(counts) - min(counts) <= 1, (layers, pp)


def _finetune_argv(data, *extra):
    return gpt2_argv(data, "--batch-size", "2", "--gas", "2", "--train-iters", "3",
                     "--hidden-dropout", "0", "--attention-dropout", "0", *extra)


@pytest.mark.slow
def test_resharded_checkpoints_train_like_the_original(gpt2_data, tmp_path):
    """tp=2 checkpoint -> (tp=1, pp=2) and (tp=1, pp=1) train like the original: the pipeline
    layout fine-tunes (--finetune: same weights, fresh optimizer, same batches) and the serial
    one resumes (--no-load-optim) with the losses of the original loaded the same way."""
    original = str(tmp_path / "tp2")
    trained = run_distributed(train_gpt2, 2, _finetune_argv(
        gpt2_data, "--model-parallel-size", "2", "--save", original), timeout=300)[0][0]
    for tp, pp in [(1, 2), (1, 1)]:
        run_conversion(ConversionRequest(original, str(tmp_path / f"tp{tp}pp{pp}"), tp=tp, pp=pp))
    reference = run_distributed(train_gpt2, 2, _finetune_argv(
        gpt2_data, "--model-parallel-size", "2", "--load", original, "--finetune"),
        timeout=300)[0][0]
    pipe = run_distributed(train_gpt2, 2, _finetune_argv(
        gpt2_data, "--pipe-parallel-size", "2", "--load", str(tmp_path / "tp1pp2"),
        "--finetune"), timeout=300)[-1][0]  # the last stage reports the loss
    assert reference[0] < trained[0] - 0.01  # the trained weights were loaded
    # Resuming with --no-load-optim keeps the iteration, consumed samples and LR schedule the
    # converter carried over; the converted file has no RNG state (the loader warns, and
    # with dropout off nothing depends on it).
    resume = ["--train-iters", "5", "--no-load-optim"]
    resumed_ref = run_distributed(train_gpt2, 2, _finetune_argv(
        gpt2_data, "--model-parallel-size", "2", "--load", original, "--no-load-rng", *resume),
        timeout=300)[0][0]
    resumed = run_distributed(train_gpt2, 1, _finetune_argv(
        gpt2_data, "--load", str(tmp_path / "tp1pp1"), *resume), timeout=300)[0][0]
    assert len(resumed_ref) == 2
    for losses, expected in ((pipe, reference), (resumed, resumed_ref)):
        assert len(losses) == len(expected)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
        assert rel < 1e-4, (losses, expected)
