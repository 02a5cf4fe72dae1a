"""The README's direct tds example ("Writing a pipeline model"), run as written: the test
reads the block from README.md and executes it (its set-up calls, the contract, the optimizer,
deepspeed.initialize with Megatron's clip) at tp=2 x pp=2 against the same layers in one
process, and at pp=2 without ``deepspeed.init_distributed()`` once torch.distributed exists
(the README says such a script may skip it). Without initialize_megatron, the first
fused-norm call, which only the last stage makes, builds or loads the kernels without a
collective the other stage never reaches (it used to hang)."""
import os
import re

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
        self.norm = mpu.RMSNorm(HIDDEN)  # the fused RMSNorm
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


LR, CLIP = 0.05, 0.5  # the clip binds: every step's norm is above it (checked below)
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
INIT_LINE = "deepspeed.init_distributed()"


def readme_block() -> str:
    """The python block under the README's "Writing a pipeline model"."""
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Writing a pipeline model"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _serial_losses(seed):
    """The layers in one process, AdamW and the same clip: the reference."""
    layers = [spec.build() for spec in _specs(seed)]
    params = [p for layer in layers for p in layer.parameters()]
    opt, batches, losses, norms = torch.optim.AdamW(params, lr=LR), iter(_batches(seed)), [], []
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
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        losses.append(total)
    return losses, norms


def _losses(seed, tp, pp, skip_init=False):
    """tp = pp = 1: the reference; else the README's block, executed as written (without its
    ``deepspeed.init_distributed()`` line when ``skip_init``), then its last line again for
    the remaining steps. Returns (losses, whether this process loaded the CPU kernels)."""
    from megatron import fused_kernels
    from megatron.fused_kernels import build

    assert not build._MODULES, "a fresh process: no kernels loaded before the first step"
    if tp * pp == 1:
        mpu.initialize_model_parallel(1, 1)
        return _serial_losses(seed), fused_kernels.get_module("cpu") is not None
    code = readme_block()
    assert code.count(INIT_LINE) == 1, code
    if skip_init:
        code = code.replace(INIT_LINE, "pass")
    ds_config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                 "train_batch_size": MICRO * GAS, "steps_per_print": 10**9,
                 "gradient_clipping": CLIP}
    data = iter(_batches(seed))
    names = dict(tp=tp, pp=pp, layers=_specs(seed), loss_fn=loss_fn, batch_fn=batch_fn,
                 ds_config=ds_config, lr=LR, data_iterator=data)
    exec(compile(code, README, "exec"), names)  # the README's calls, nothing else
    losses = [float(names["loss"])]
    losses += [float(names["engine"].train_batch(data)) for _ in range(STEPS - 1)]
    return losses, "cpu" in build._MODULES


def test_readme_pipeline_block_as_written_at_tp2_pp2_equals_the_layers_in_one_process(seed):
    ((serial, norms), kernels) = run_distributed(_losses, 1, seed, 1, 1, timeout=120)[0]
    assert min(norms) > CLIP and kernels  # the clip acts; the serial run fused its norm too
    ranks = run_distributed(_losses, 4, seed, 2, 2, timeout=180)
    for rank, (losses, _) in enumerate(ranks[2:], start=2):  # the last stage reports the loss
        assert len(losses) == STEPS, rank
        assert max(abs(a - b) for a, b in zip(losses, serial)) < 1e-5, (rank, losses, serial)
    assert [k for _, k in ranks] == [False, False, True, True]  # only the norm's stage


def test_readme_pipeline_block_without_init_distributed_when_the_group_exists(seed):
    ((serial, _), _) = run_distributed(_losses, 1, seed, 1, 1, timeout=120)[0]
    ranks = run_distributed(_losses, 2, seed, 1, 2, True, timeout=120)
    losses, kernels = ranks[1]
    assert len(losses) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, serial)) < 1e-5, (losses, serial)
    assert kernels and not ranks[0][1]  # only the norm's stage loaded the kernels
