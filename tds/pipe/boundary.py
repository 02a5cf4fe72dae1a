"""Learn the inter-stage shapes once, before the first step, and check them everywhere.

Stage 0 runs the first micro-batch forward (no grad, the module in eval mode, so no
dropout draws from any generator), checks its output tuple against the contract and sends a
small header (dtype and shape per position, or an error flag) to stage 1, which runs its
forward on zero tensors of those shapes, and so on. Then every rank joins one all-gather of
error messages, so a broken contract raises the same ValueError on every rank of the job.
torch's own generators are restored too, so the probe changes nothing.
"""
import contextlib
from typing import Any, Tuple

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
HEADER_SIZE = 128
_OK, _ERROR = 1, 2


def _encode(tensors):
    """``[status, n, (dtype id, ndim, dims...)*]`` as an int64 header."""
    values = [_OK, len(tensors)]
    for t in tensors:
        values += [DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(values) > HEADER_SIZE:
        raise ValueError(f"inter-stage tuple too large to describe ({len(values)} header "
                         f"entries, at most {HEADER_SIZE})")
    header = torch.zeros(HEADER_SIZE, dtype=torch.long)
    header[:len(values)] = torch.tensor(values)
    return header


def _decode(header):
    values = header.tolist()
    if values[0] != _OK:
        return None
    meta, offset = [], 2
    for _ in range(values[1]):
        dtype, ndim = DTYPES[values[offset]], values[offset + 1]
        meta.append((tuple(values[offset + 2:offset + 2 + ndim]), dtype))
        offset += 2 + ndim
    return meta


@contextlib.contextmanager
def _side_effect_free(module):
    """No grad, eval mode (dropout draws nothing), torch's generators restored after."""
    training = module.training
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(training)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _stage_forward(engine, inputs):
    with _side_effect_free(engine.module):
        return engine.module(inputs)


def _probe(engine):
    """This stage's part of the probe; returns (recv_meta, send_meta, error).

    ``error`` is None, an exception raised here, or "" when an upstream stage failed.
    """
    recv_meta = send_meta = None
    error = None
    device = engine.device
    try:
        if engine.is_first_stage():
            inputs = engine._peek_first_batch()
        else:
            header = torch.empty(HEADER_SIZE, dtype=torch.long, device=device)
            dist.recv(header, engine.prev_rank)
            recv_meta = _decode(header.cpu())
            if recv_meta is None:
                raise _UpstreamError()
            inputs = tuple(torch.zeros(shape, dtype=dtype, device=device)
                           for shape, dtype in recv_meta)
        outputs = _stage_forward(engine, inputs)
        if not engine.is_last_stage():
            engine.contract.check_tensors(outputs, engine.link.tp_size,
                                          f"pipeline stage {engine.stage_id} output")
            send_meta = [(tuple(t.shape), t.dtype) for t in outputs]
            dist.send(_encode(outputs).to(device), engine.next_rank)
    except _UpstreamError:
        error = ""
    except Exception as exc:  # anything: downstream stages must not wait forever
        error = exc
    if error is not None and not engine.is_last_stage() and send_meta is None:
        bad = torch.zeros(HEADER_SIZE, dtype=torch.long, device=device)
        bad[0] = _ERROR
        dist.send(bad, engine.next_rank)  # downstream stops waiting and fails too
    return recv_meta, send_meta, error


class _UpstreamError(Exception):
    pass


def discover_boundary(engine: Any) -> Tuple[Any, Any]:
    """Run the probe (collective over the whole job). Returns (recv_meta, send_meta).

    Raises:
        ValueError: on every rank, with the message of the first rank that found a problem.
    """
    recv_meta, send_meta, error = _probe(engine)
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, str(error) if error else None)
    first = next(((rank, m) for rank, m in enumerate(messages) if m), None)
    if isinstance(error, Exception):
        raise error
    if first is not None:
        raise ValueError(f"{first[1]} (found on rank {first[0]})")
    return recv_meta, send_meta
