"""tds's pipeline engine on a small typed model: serial equivalence, p2p volume, contract errors.

The model passes ``(hidden float [s, b, h], mask bool [s, b])`` between stages, with the
hidden state split across tensor-parallel ranks for the send.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_distributed
from megatron import mpu
from megatron.model.utils import init_rng

VOCAB, HIDDEN, SEQ, MICRO = 16, 8, 6, 2
CLIP = 1.0  # active: the serial norm is ~3, so the engine's clip must count every grad once


class Embed(nn.Module):
    def __init__(self, seed):
        super().__init__()
        with init_rng(seed, "embed"):
            self.emb = mpu.VocabParallelEmbedding(VOCAB, HIDDEN, init_method=nn.init.normal_)

    def forward(self, inputs):
        ids, mask = inputs                                   # [b, s], [b, s]
        return self.emb(ids).transpose(0, 1).contiguous(), mask.transpose(0, 1).contiguous()


class Block(nn.Module):
    def __init__(self, seed, index):
        super().__init__()
        with init_rng(seed, "block", index):
            self.fc1 = mpu.ColumnParallelLinear(HIDDEN, 4 * HIDDEN, gather_output=False)
            self.fc2 = mpu.RowParallelLinear(4 * HIDDEN, HIDDEN, input_is_parallel=True)

    def forward(self, inputs):
        hidden, mask = inputs                                # [s, b, h] float, [s, b] bool
        update, _ = self.fc2(torch.tanh(self.fc1(hidden)[0]))
        return hidden + update * mask.unsqueeze(-1), mask


class Head(nn.Module):
    def __init__(self, seed):
        super().__init__()
        with init_rng(seed, "head"):
            self.out = mpu.ColumnParallelLinear(HIDDEN, VOCAB, gather_output=True)

    def forward(self, inputs):
        hidden, _ = inputs
        return self.out(hidden)[0]                           # [s, b, v]


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.transpose(0, 1).reshape(-1))


def batch_fn(raw):
    """raw (tp rank 0 only) -> ((ids, mask), labels), shared over the tp group."""
    data = None if raw is None else {"ids": raw[0], "labels": raw[1]}
    got = mpu.broadcast_data(["ids", "labels"], data, torch.int64)
    return (got["ids"], got["ids"] != 0), got["labels"]


def _batches(seed, count):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g),
             torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)) for _ in range(count)]


def _specs(seed, blocks=4):
    from tds import LayerSpec

    return [LayerSpec(Embed, seed)] + [LayerSpec(Block, seed, i) for i in range(blocks)] + \
        [LayerSpec(Head, seed)]


def _serial_losses(seed, steps, gas):
    """Reference: the same layers in one process, plain PyTorch SGD."""
    mpu.initialize_model_parallel(1, 1)
    layers = [spec.build() for spec in _specs(seed)]
    params = [p for layer in layers for p in layer.parameters()]
    opt = torch.optim.SGD(params, lr=0.5)
    batches = iter(_batches(seed, steps * gas))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for _ in range(gas):
            ids, labels = next(batches)
            x = (ids, ids != 0)
            for layer in layers:
                x = layer(x)
            loss = loss_fn(x, labels) / gas
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        losses.append(total)
    return losses


def _engine(seed, tp, pp, dp, gas, contract=None, seq=SEQ, vpp=1):
    import tds as deepspeed
    from tds.pipe import PipeModelDataParallelTopology, PipelineModule

    mpu.initialize_model_parallel(tp, pp)
    deepspeed.init_distributed(dist_backend="gloo")
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    model = PipelineModule(layers=_specs(seed), topology=topo, loss_fn=loss_fn,
                           partition_method="uniform", num_virtual_stages=vpp)
    types, grads, parts = contract or (["float", "bool"], [True, False], [True, False])
    model._input_type, model._input_grad, model._input_pipe_partitioned = types, grads, parts
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
              "train_batch_size": MICRO * gas * dp, "steps_per_print": 10**9,
              "gradient_clipping": CLIP}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                      batch_fn=batch_fn)
    return engine


def _pipeline_losses(seed, tp, pp, dp, steps, gas, vpp=1):
    engine = _engine(seed, tp, pp, dp, gas, vpp=vpp)
    batches = _batches(seed, steps * gas * dp)
    dp_rank = mpu.get_data_parallel_rank()
    # Global micro-batch order: each step takes gas x dp micro-batches; dp rank r takes every
    # dp-th one, as the Megatron sampler does.
    mine = iter([b for i, b in enumerate(batches) if i % dp == dp_rank])
    losses = [float(engine.train_batch(mine)) for _ in range(steps)]
    return losses, engine.link.bytes_sent


@pytest.mark.parametrize("tp,pp,dp", [(1, 2, 1), (2, 2, 1), (1, 3, 1), (1, 2, 2)])
def test_pipeline_matches_serial(seed, tp, pp, dp):
    steps, gas = 3, 4 // dp
    (serial,) = run_distributed(_serial_losses, 1, seed, steps, 4)
    results = run_distributed(_pipeline_losses, tp * pp * dp, seed, tp, pp, dp, steps, gas,
                              timeout=240)
    for rank, (losses, _) in enumerate(results):
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, serial)) < 1e-5, \
            (rank, losses, serial)
    # No "loss falls" check: 3 SGD steps on random labels may go either way. Steps 2 and 3 are
    # computed with updated weights, so matching them means the engine took the same steps.


def test_virtual_stages_match_serial(seed):
    """Interleaved 1F1B (2 chunks per rank, 3 micro-batches: not a multiple of p) on a
    model that is not GPT-2 or T5, through tds's API alone."""
    (serial,) = run_distributed(_serial_losses, 1, seed, 3, 3)
    results = run_distributed(_pipeline_losses, 2, seed, 1, 2, 1, 3, 3, 2, timeout=240)
    for rank, (losses, _) in enumerate(results):
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, serial)) < 1e-5, \
            (rank, losses, serial)


def _interleaved_contract_error(seed):
    try:
        engine = _engine(seed, 1, 2, 1, 1, (["float", "float"], [True, True], [False, False]),
                         vpp=2)
        engine.train_batch(iter(_batches(seed, 1)))
    except ValueError as exc:
        return str(exc)
    return None


def test_virtual_stage_contract_error_names_the_chunk_on_every_rank(seed):
    messages = run_distributed(_interleaved_contract_error, 2, seed, timeout=120)
    expected = "pipeline chunk 0 output: position 1 is a torch.bool tensor but _input_grad[1]"
    assert all(m is not None and expected in m for m in messages), messages


def test_partitioned_position_halves_p2p_volume(seed):
    full = run_distributed(_bytes_for, 4, seed, [True, False])
    split = run_distributed(_bytes_for, 4, seed, [False, False])
    for rank in range(4):
        (hidden_p, mask_p), (hidden_f, mask_f) = full[rank], split[rank]
        if hidden_f == 0:  # the last stage sends only gradients of what it received
            continue
        assert hidden_p * 2 == hidden_f and mask_p == mask_f, (rank, full, split)


def _bytes_for(seed, partitioned):
    """Bytes sent per micro-batch by this rank, split into (hidden, mask) positions."""
    engine = _engine(seed, 2, 2, 1, 1, (["float", "bool"], [True, False], partitioned))
    link = engine.link
    sizes = []
    original = link.send

    def counting_send(tensor, dst, part):
        before = link.bytes_sent
        original(tensor, dst, part)
        sizes.append((tensor.dtype, link.bytes_sent - before))

    link.send = counting_send
    engine.train_batch(iter(_batches(seed, 1)))
    hidden = sum(n for dtype, n in sizes if dtype.is_floating_point)
    mask = sum(n for dtype, n in sizes if dtype == torch.bool)
    return hidden, mask


def _contract_error(seed, contract, seq):
    try:
        engine = _engine(seed, 2, 2, 1, 1, contract)
        engine.train_batch(iter([(torch.randint(0, VOCAB, (1, seq)),) * 2]))
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("contract,seq,message", [
    ((["float"], [True, False], [True, False]), SEQ,
     "_input_type has 1 positions, _input_grad 2"),
    ((["float", "int"], [True, True], [True, False]), SEQ,
     "position 1 is 'int' but _input_grad[1] is True"),
    ((["float", "bool"], [True, False], [False, True]), 3,
     "position 1 (shape (3, 1), 3 elements) is marked _input_pipe_partitioned"),
    ((["bool", "bool"], [False, False], [False, False]), SEQ,
     "position 0 is a torch.float32 tensor but _input_type[0] is 'bool'"),
])
def test_contract_errors_raise_on_every_rank(seed, contract, seq, message):
    messages = run_distributed(_contract_error, 4, seed, contract, seq, timeout=120)
    assert all(m is not None and message in m for m in messages), messages


def test_deepspeed_older_than_the_oldest_tested_is_refused_and_later_ones_admitted():
    import re

    import tds

    # setup.py admits from the oldest tds accepts, and .ci/run tests exactly that release
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    floor = re.search(r'"deepspeed>=([0-9.]+)"', open(os.path.join(repo, "setup.py")).read())
    assert floor and tuple(map(int, floor.group(1).split("."))) == tds.OLDEST_DEEPSPEED
    ci = open(os.path.join(repo, ".ci", "run")).read()
    assert "OLDEST_DEEPSPEED" in ci and "tests/test_tds_engine.py" in ci

    oldest = ".".join(map(str, tds.OLDEST_DEEPSPEED))
    for version in (f"{oldest}.0", "0.19.8", "0.20.0", "1.0.0"):
        tds._check_version(version)  # public API only: later releases are admitted
    major, minor = tds.OLDEST_DEEPSPEED
    for version in (f"{major}.{minor - 1}.9", "0.3.16"):
        with pytest.raises(ImportError, match=f"pip install 'deepspeed>={oldest}'"):
            tds._check_version(version)


def _plain_module_engine(seed):
    """tds.initialize on a non-pipeline module is DeepSpeed's own engine and step."""
    import deepspeed as real
    import tds

    tds.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2,
              "gradient_clipping": 0.0, "steps_per_print": 10**9}
    losses = {}
    for name, api in (("tds", tds), ("deepspeed", real)):
        torch.manual_seed(seed)
        model = nn.Linear(4, 3)
        engine, *_ = api.initialize(model=model, config=config,
                                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randn(2, 4)
        for _ in range(2):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
        losses[name] = (type(engine).__name__, float(loss))
    return losses


def test_initialize_on_a_plain_module_is_deepspeed(seed):
    (losses,) = run_distributed(_plain_module_engine, 1, seed)
    assert losses["tds"] == losses["deepspeed"]
    assert losses["tds"][0] == "DeepSpeedEngine"


def test_contract_names_a_shape_change_and_accepts_cpm_declarations():
    """CPM's TDS sent every tensor in its own dtype: a float mask declared 'int' passes;
    a batch whose shape differs from the learned one names the position and the fix."""
    from tds.pipe import StageContract

    contract = StageContract.build(["float", "int"], [True, False], [True, False])
    hidden, float_mask = torch.randn(4, 2, 8), torch.ones(2, 1, 4, 4)
    contract.check_tensors((hidden, float_mask), 2, "stage 0 output")
    meta = [((4, 2, 8), torch.float32), ((2, 1, 4, 4), torch.float32)]
    contract.check_shapes((hidden, float_mask), meta, "stage 0 output")
    with pytest.raises(ValueError, match=r"position 0 is \(5, 2, 8\) torch.float32, but the "
                                         r"first batch's was \(4, 2, 8\).*reset_activation_shape"):
        contract.check_shapes((torch.randn(5, 2, 8), float_mask), meta, "stage 0 output")
    with pytest.raises(ValueError, match="the stage produced 1 tensors but the contract "
                                         "describes 2 positions"):
        contract.check_tensors((hidden,), 2, "stage 0 output")
    with pytest.raises(ValueError, match=r"produced a Tensor, not a tuple; return a tuple of "
                                         r"the 1 tensor"):  # a user's stage returning x
        StageContract.build(["float"], [True], [False]).check_tensors(hidden, 2, "stage 0")


def test_pipeline_module_without_a_process_group_names_the_call():
    import torch.distributed as dist
    from deepspeed import comm as ds_comm

    from tds.pipe import PipelineModule

    if dist.is_initialized() or ds_comm.is_initialized():
        pytest.skip("this process already has a process group")
    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group\(\)"):
        PipelineModule(layers=[torch.nn.Linear(2, 2)], num_stages=1)


class _FloatMaskEmbed(Embed):
    """The mask travels as a float (a user's choice): a float position with no gradient."""

    def forward(self, inputs):
        hidden, mask = super().forward(inputs)
        return hidden, mask.float()


def _grad_contract_error(seed, grads, float_mask):
    """A wrong _input_grad: (the error on this rank, whether the weights stayed as built)."""
    import tds as deepspeed
    from tds.pipe import PipeModelDataParallelTopology, PipelineModule

    mpu.initialize_model_parallel(1, 2)
    deepspeed.init_distributed(dist_backend="gloo")
    specs = _specs(seed)
    if float_mask:
        from tds import LayerSpec

        specs[0] = LayerSpec(_FloatMaskEmbed, seed)
    model = PipelineModule(layers=specs, topology=PipeModelDataParallelTopology(2, 1, 1),
                           loss_fn=loss_fn, partition_method="uniform")
    model._input_type = ["float", "float" if float_mask else "bool"]
    model._input_grad, model._input_pipe_partitioned = grads, [False, False]
    before = [p.detach().clone() for p in model.parameters()]
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), batch_fn=batch_fn,
        config={"train_micro_batch_size_per_gpu": MICRO, "train_batch_size": MICRO})
    try:
        engine.train_batch(iter(_batches(seed, 1)))
    except ValueError as exc:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return str(exc), unchanged
    return None, None


@pytest.mark.parametrize("grads,float_mask,message", [
    ([False, False], False, "position 0 carries a gradient .* but _input_grad\\[0\\] is False"),
    ([True, True], True, "position 1 carries no gradient .* but _input_grad\\[1\\] is True")])
def test_a_wrong_input_grad_is_refused_on_every_rank_before_the_optimizer_steps(
        seed, grads, float_mask, message):
    import re

    for error, unchanged in run_distributed(_grad_contract_error, 2, seed, grads, float_mask,
                                            timeout=120):
        assert error is not None and re.search(message, error), error
        assert "pipeline stage 0, chunk 0 output" in error and unchanged
