"""Build the model, wrap it for data parallelism, and create optimizer and LR schedule."""
from torch.nn.parallel import DistributedDataParallel

from . import mpu
from .learning_rates import AnnealingLR
from .optimizer import get_megatron_optimizer


def _report_parameters(model):
    count = sum(p.numel() for p in model.parameters())
    state = mpu.get_parallel_state()
    if state.dp_rank == 0:
        print(f" > number of parameters on (tensor, pipeline) model parallel rank "
              f"({state.tp_rank}, {state.pp_rank}): {count}", flush=True)


def wrap_data_parallel(model):
    """torch DDP over the data-parallel group (nothing to do with one replica)."""
    group = mpu.get_data_parallel_group()
    if mpu.get_data_parallel_world_size() == 1:
        return model
    device = mpu.get_device()
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                   process_group=group, broadcast_buffers=False)


def setup_model_and_optimizer(model_provider, args):
    """``model_provider()`` -> (model, optimizer, lr_scheduler), ready to train.

    A pipeline model (or ``--deepspeed``) goes to tds's engine, which owns its optimizer,
    precision and data parallelism; otherwise the model gets torch DDP, our AdamW wrapper
    and the LR schedule.
    """
    model = model_provider()
    _report_parameters(model)
    if args.pipeline_model_parallel_size > 1 or args.deepspeed:
        from .engine_setup import setup_engine

        return setup_engine(model, args)
    model = wrap_data_parallel(model)
    optimizer = get_megatron_optimizer([model], args)
    lr_scheduler = AnnealingLR(optimizer, args.lr, args.min_lr, args.lr_warmup_iters,
                               args.lr_decay_iters, args.lr_decay_style)
    return model, optimizer, lr_scheduler


