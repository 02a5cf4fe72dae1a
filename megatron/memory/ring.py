"""What the context-parallel attention holds beyond what it saves, in its forward and its
backward, per rank (megatron/mpu/cp_attention.py, ring_attention.py, attention_blocks.py).

Saved for the backward (:func:`~megatron.memory.activations.ring_core`): q, k, v, the output
and the fp32 log-sum-exp, as SDPA at cp 1, of the rank's ``T = s / cp x b`` tokens. The
working sets below are counted as the code allocates and frees them, step by step of the
ring (each step is one block: rank ``r`` against the keys of ``src = r - t``; ``rows x
cols`` of the local ``T`` queries and keys: ``T x T`` causal when ``src == r``, ``T x T/2``
when ``src < r``, ``T/2 x T`` when ``src > r``), and the worst moment of the worst rank
is returned. Units (per tensor-parallel rank, ``P = heads x kv_channels / t``, ``K =
kv_heads x kv_channels / t``, ``e`` the compute dtype's bytes):

- ``p2p``: the stacked keys and values (``2 T K e``), the block arriving while this one
  computes (``2 T K e``), the fp32 output accumulator (``T P 4``, which *is* the saved
  output in fp32) and the merge's temporaries (three ``rows x P`` fp32 tensors and the
  block's output); in the backward the fp32 ``dq`` (``T P 4``), each block's ``dq, dk, dv``
  (kept until the next block's are made), the ``[2, T, K]`` fp32 part a rank adds to the
  travelling ``dK, dV`` accumulator, the sum it sends (held by the send until the next
  step) and the accumulator it receives (``2 T K 4`` each);
- ``all_gather``: the whole sequence's keys and values (``cp x 2 T K e``) instead of the
  ring's two blocks, and in the backward their fp32 gradients (``cp x 2 T K 4``);
- ``a2a``: SDPA on the whole sequence of ``heads / cp`` heads, the all-to-alls' send and
  receive buffers (``T P e`` each).

On the CPU each block runs PyTorch's fused flash-attention kernel for the CPU, whose
outputs (``rows x P``, and ``cols x K`` repeated to every query head of a key-value head)
are counted; its scratch space inside the op is not (nor by the peak tracker). Elsewhere
(CUDA) the blocks are plain PyTorch in fp32 in tiles of at most
:data:`megatron.mpu.attention_blocks.TILE_BYTES` (about three tiles at once): counted so,
not measured.
"""
from typing import List, Tuple

from .spec import MemorySpec

#: megatron.mpu.attention_blocks.TILE_BYTES (read here without importing torch).
TILE_BYTES = 32 * 2**20


def _units(spec: MemorySpec, tokens: int):
    """``(Q, Q4, K, K4, L)``: q-width rows in the compute dtype and in fp32, one of k / v
    likewise, the fp32 log-sum-exp of ``tokens`` rows."""
    t, e = spec.tp, spec.e
    p, k = spec.heads * spec.kv_channels // t, spec.kv_proj // t
    return tokens * p * e, tokens * p * 4, tokens * k * e, tokens * k * 4, \
        tokens * spec.heads // t * 4


def steps(cp: int, rank: int) -> List[Tuple[float, float]]:
    """``(rows, cols)`` of each ring step of ``rank``, as fractions of its tokens
    (megatron/mpu/ring_attention.py ``step_plan``)."""
    out = []
    for t in range(cp):
        src = (rank - t) % cp
        out.append((1.0, 1.0) if src == rank else (1.0, 0.5) if src < rank else (0.5, 1.0))
    return out


def _block_backward(spec: MemorySpec, tokens: int, r: float, c: float) -> int:
    """One block's backward beyond the ring's buffers: its ``dq, dk, dv`` as the kernel
    makes them and their fp32 forms (keys and values repeated per query head)."""
    q, q4, k, k4, _ = _units(spec, tokens)
    g = spec.heads // (spec.kv_heads or spec.heads)
    if spec.device != "cpu":  # plain PyTorch in fp32 tiles (about three at once)
        floats = 2 * c * k4 if spec.e < 4 else 0  # fp32 copies of k and v
        return int(r * q4 + 2 * c * k4 + floats + 3 * _tile(spec, tokens, r, c))
    repeated = 2 * c * g * k if g > 1 else 0
    return int(repeated + r * q + 2 * c * g * k + (r * q4 if spec.e < 4 else 0) +
               2 * c * k4 + (c * g * k4 if spec.e < 4 else 0))


def _tile(spec: MemorySpec, tokens: int, r: float, c: float) -> int:
    """One fp32 score tile of the plain-PyTorch blocks."""
    return int(min(TILE_BYTES, 4 * spec.heads // spec.tp * r * c * tokens * tokens //
                   spec.micro_batch))


def _block_forward(spec: MemorySpec, tokens: int, r: float, c: float, prev: float) -> int:
    """One block's forward beyond the ring's buffers, the larger of two moments: the
    kernel making its output while the last block's (``prev`` rows) is still held, and the
    merge (the block's fp32 output, two rescaled products and their sum)."""
    q, q4, k, _, lse = _units(spec, tokens)
    g = spec.heads // (spec.kv_heads or spec.heads)
    if spec.device != "cpu":
        return int(2 * r * q4 + r * lse + (2 * c * k * 4 // spec.e if spec.e < 4 else 0) +
                   2 * _tile(spec, tokens, r, c))
    repeated = 2 * c * g * k if g > 1 else 0
    kernel = prev * (q4 + lse) + repeated + r * q + (r * q4 if spec.e < 4 else 0)
    return int(max(kernel, r * (q4 + lse) + 3 * r * (q4 + lse)))


def _kv_buffers(spec: MemorySpec, tokens: int, t: int, backward: bool) -> int:
    """Keys and values held at step ``t``: the stacked local ones (the backward keeps
    them), the current and the arriving block (p2p), or the whole sequence's
    (all_gather)."""
    _, _, k, _, _ = _units(spec, tokens)
    cp = spec.cp
    if spec.cp_comm == "all_gather":
        return 2 * k * cp + (2 * k if backward else 0)
    held = 2 * k if backward or t == 0 else 0  # the stack (the forward's is current at 0)
    held += 2 * k if t >= 1 else 0  # the block received for this step
    return held + (2 * k if t < cp - 1 else 0)  # the block on its way for the next


def forward_extra(spec: MemorySpec, tokens: int) -> int:
    """Bytes the context-parallel attention's forward holds at its worst moment beyond
    what it leaves saved (:func:`~megatron.memory.activations.ring_core`) and its inputs.

    Args:
        spec: the run (cp > 1).
        tokens: the rank's tokens (``s / cp x b``).
    """
    q, q4, k, _, _ = _units(spec, tokens)
    if spec.cp_comm == "a2a":  # an all-to-all's send and receive; keys and values before
        return 2 * q + (2 * k if spec.kv_proj != spec.heads * spec.kv_channels else 0)
    acc = q4 - q  # the fp32 accumulator and log-sum-exp less the saved output and lse
    worst = 0
    for rank in range(spec.cp):
        plan = steps(spec.cp, rank)
        for t, (r, c) in enumerate(plan):
            prev = plan[t - 1][0] if t else 0.0
            worst = max(worst, acc + _kv_buffers(spec, tokens, t, False) +
                        _block_forward(spec, tokens, r, c, prev))
    return int(worst)


def backward_extra(spec: MemorySpec, tokens: int) -> int:
    """Bytes the context-parallel attention's backward holds at its worst moment beyond
    its saved tensors and the output's gradient.

    Args:
        spec: the run (cp > 1).
        tokens: the rank's tokens (``s / cp x b``).
    """
    _, q4, _, k4, lse = _units(spec, tokens)
    if spec.cp_comm == "a2a":
        return _a2a_backward(spec, tokens)
    base = q4 + lse  # dq in fp32, rowsum(dout * out)
    gathered = spec.cp_comm == "all_gather"
    worst = 0
    for rank in range(spec.cp):
        plan = steps(spec.cp, rank)
        for t, (r, c) in enumerate(plan):
            held = base + _kv_buffers(spec, tokens, t, True)
            mine = r * q4 + 2 * c * k4  # this block's dq, dk, dv
            if gathered:  # the sequence's fp32 gradients; this part and the last
                parts = 2 * k4 * spec.cp + (2 * k4 if t else 0)
                during = parts + (plan[t - 1][0] * q4 + 2 * plan[t - 1][1] * k4 if t else 0)
                worst = max(worst, held + during + _block_backward(spec, tokens, r, c),
                            held + parts + 2 * k4 + mine)
                continue
            prev = plan[t - 1][0] * q4 + 2 * plan[t - 1][1] * k4 if t else 0
            # the last step's part, the sum it sent (a second tensor after step 1) and
            # the accumulator that arrived
            sent = 2 * k4 * (1 + (t >= 2) + 1) if t else 0
            worst = max(worst, held + prev + sent + _block_backward(spec, tokens, r, c))
            # adding this step's part: the last send, its arrival, the part, its sum
            # with the arrival and the next arrival
            worst = max(worst, held + mine + 2 * k4 * (5 if t else 2))
    return int(worst)


def _a2a_backward(spec: MemorySpec, tokens: int) -> int:
    """Ulysses' backward: the output gradient all-to-all'd (send and receive) and put back
    in the sequence's order, SDPA's backward over the whole sequence of ``heads / cp``
    heads (its q, k, v gradients, keys and values repeated), then each of them back
    through an all-to-all."""
    q, _, _, _, _ = _units(spec, tokens)
    return 4 * q
