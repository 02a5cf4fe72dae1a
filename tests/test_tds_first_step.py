"""The README's direct tds example ("Writing a pipeline model") at pp=2, without
initialize_megatron: the first fused-norm call, which only the last stage makes, builds or
loads the kernels without a collective the other stage never reaches (it used to hang)."""
import torch
import torch.nn.functional as F
from torch import nn

from harness import run_distributed
from megatron import mpu
from megatron.model.utils import init_rng

VOCAB, HIDDEN, SEQ, MICRO, GAS, STEPS = 16, 8, 6, 2, 2, 3


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
            self.fc = mpu.ColumnParallelLinear(HIDDEN, HIDDEN, gather_output=True)

    def forward(self, inputs):
        hidden, mask = inputs                                # [s, b, h], [s, b]
        return hidden + torch.tanh(self.fc(hidden)[0]) * mask.unsqueeze(-1), mask


class NormHead(nn.Module):
    """Only the last stage holds a fused norm: its first call is the lazy kernel load."""

    def __init__(self, seed):
        super().__init__()
        from megatron.model.fused_layer_norm import MixedFusedRMSNorm

        self.norm = MixedFusedRMSNorm(HIDDEN)
        with init_rng(seed, "head"):
            self.out = mpu.ColumnParallelLinear(HIDDEN, VOCAB, gather_output=True)

    def forward(self, inputs):
        hidden, _ = inputs
        return self.out(self.norm(hidden))[0]                # [s, b, v]


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.transpose(0, 1).reshape(-1))


def batch_fn(raw):
    data = None if raw is None else {"ids": raw[0], "labels": raw[1]}
    got = mpu.broadcast_data(["ids", "labels"], data, torch.int64)
    return (got["ids"], got["ids"] != 0), got["labels"]


def _specs(seed):
    from tds import LayerSpec

    return [LayerSpec(Embed, seed), LayerSpec(Block, seed, 0), LayerSpec(Block, seed, 1),
            LayerSpec(NormHead, seed)]


def _batches(seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, VOCAB, (MICRO, SEQ), generator=g),
             torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)) for _ in range(STEPS * GAS)]


def _losses(seed, pp):
    """pp=1: the layers in one process with SGD; pp=2: the README's engine, nothing else."""
    import tds as deepspeed
    from tds.pipe import PipeModelDataParallelTopology, PipelineModule

    from megatron import fused_kernels
    from megatron.fused_kernels import build

    assert not build._MODULES, "a fresh process: no kernels loaded before the first step"
    mpu.initialize_model_parallel(1, pp)
    if pp == 1:
        layers = [spec.build() for spec in _specs(seed)]
        params = [p for layer in layers for p in layer.parameters()]
        opt, batches, losses = torch.optim.SGD(params, lr=0.5), iter(_batches(seed)), []
        for _ in range(STEPS):
            opt.zero_grad()
            total = 0.0
            for _ in range(GAS):
                ids, labels = next(batches)
                x = (ids, ids != 0)
                for layer in layers:
                    x = layer(x)
                loss = loss_fn(x, labels) / GAS
                loss.backward()
                total += loss.item()
            opt.step()
            losses.append(total)
        return losses, fused_kernels.get_module("cpu") is not None
    deepspeed.init_distributed(dist_backend="gloo")
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=1, num_dp=1)
    model = PipelineModule(layers=_specs(seed), topology=topo, loss_fn=loss_fn,
                           partition_method="uniform")
    model._input_type, model._input_grad = ["float", "bool"], [True, False]
    model._input_pipe_partitioned = [False, False]
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "train_batch_size": MICRO * GAS, "steps_per_print": 10**9}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                      batch_fn=batch_fn)
    data = iter(_batches(seed))
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    return losses, "cpu" in build._MODULES


def test_readme_pipeline_at_pp2_runs_its_first_step_without_extra_calls(seed):
    (serial,) = run_distributed(_losses, 1, seed, 1, timeout=120)
    ranks = run_distributed(_losses, 2, seed, 2, timeout=120)
    losses, kernels = serial
    assert len(ranks[1][0]) == STEPS
    assert max(abs(a - b) for a, b in zip(ranks[1][0], losses)) < 1e-5
    assert ranks[1][1] and not ranks[0][1]  # only the norm's stage loaded the kernels
    assert kernels  # the serial run took the fused path too: the same op on both sides
