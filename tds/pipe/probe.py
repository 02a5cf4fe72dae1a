"""Learn the inter-chunk shapes once, before the first step, and check them everywhere.

The owner of chunk 0 runs the first micro-batch forward (no grad, the module in eval mode so
no dropout draws, torch's generators restored after), checks its output tuple against the
contract and sends a small header (dtype and shape per position, or an error flag) to the
owner of chunk 1 (or hands the tuple on where the same rank holds both, the turn of a V),
which runs its chunk on zero tensors of those shapes, and so on through every chunk. Then
every rank joins one all-gather of error messages, so a broken contract raises the same
ValueError on every rank of the job instead of a hang between two stages.
"""
import contextlib
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .contract import StageContract
from .runner import Boundary

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
def side_effect_free(module):
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


def probe_chunks(module, placement, stage_id: int, stage_ranks: Sequence[int],
                 contract: StageContract, tp_size: int, device: torch.device,
                 run_chunk: Callable, first_inputs: Optional[tuple]) -> List[Boundary]:
    """Learn every chunk boundary's (shape, dtype) per position (collective over the job).

    Args:
        module: the pipeline module (eval mode and no grad while probing).
        placement: its chunk placement.
        stage_id: this rank's pipeline rank; ``stage_ranks``: the global rank of each stage.
        contract: what crosses each boundary; ``tp_size``: for the divisibility check.
        device: where received tensors are made.
        run_chunk: ``f(local index j, inputs) -> outputs`` of this rank's j-th chunk.
        first_inputs: chunk 0's inputs for the first micro-batch (its owner; None elsewhere).

    Returns:
        the ``Boundary`` after each chunk c = 0 .. num_chunks - 2 of this pipeline.

    Raises:
        ValueError: on every rank, naming the chunk and the first rank that failed.
    """
    num_chunks = placement.num_chunks
    sent, error, handed = {}, None, None
    for j, chunk in enumerate(placement.chunks(stage_id)):
        try:
            if chunk == 0:
                inputs = first_inputs
            elif placement.is_local(chunk - 1):
                inputs = handed
            else:
                inputs = _recv_inputs(device, stage_ranks[placement.owner(chunk - 1)])
            handed = None
            if error is None and inputs is not None:
                with side_effect_free(module):
                    outputs = run_chunk(j, inputs)
                if chunk < num_chunks - 1:
                    contract.check_tensors(outputs, tp_size, f"pipeline chunk {chunk} output")
                    sent[chunk] = tuple((tuple(t.shape), t.dtype) for t in outputs)
                    if placement.is_local(chunk):  # the same rank runs chunk + 1 next
                        handed = outputs
                    else:
                        dist.send(_encode(outputs).to(device),
                                  stage_ranks[placement.owner(chunk + 1)])
                    continue
        except Exception as exc:  # downstream chunks must not wait forever
            error = error or exc
        if chunk < num_chunks - 1 and chunk not in sent and not placement.is_local(chunk):
            bad = torch.zeros(HEADER_SIZE, dtype=torch.long, device=device)
            bad[0] = _ERROR
            dist.send(bad, stage_ranks[placement.owner(chunk + 1)])
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (str(error) if error else None, sent))
    first = next(((rank, r[0]) for rank, r in enumerate(reports) if r[0]), None)
    if first is not None:
        raise ValueError(f"{first[1]} (found on rank {first[0]})")
    meta = {}
    for rank in stage_ranks:
        meta.update(reports[rank][1])
    return [Boundary(contract, meta[c]) for c in range(num_chunks - 1)]


def _recv_inputs(device, src):
    """Zero inputs of the shapes the previous chunk announced, or None after an error."""
    header = torch.empty(HEADER_SIZE, dtype=torch.long, device=device)
    dist.recv(header, src)
    meta = _decode(header.cpu())
    if meta is None:
        return None
    return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in meta)
