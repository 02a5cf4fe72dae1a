"""Context parallelism's attention and data pieces (megatron/mpu/context_parallel.py,
ring_attention.py, cp_attention.py) against plain PyTorch on the whole sequence.

One 4-rank launch runs cp 4, cp 2 beside tp 2, and cp 1, each with the ring (p2p), the
all-gather and the all-to-all (Ulysses) forms, causal and with Megatron's document mask,
with as many key-value heads as query heads and grouped (2 for 4), with the CPU's fused
kernel per block and with the plain-PyTorch blocks (whole, and in score tiles of a few
rows): outputs and the gradients of q, k and v equal the reference's.
"""
import pytest
import torch

from cp_runs import EOD, attention_errors, megatron_document_mask
from harness import run_distributed

LAYOUTS = [(4, 1), (2, 2), (1, 4)]
CASES = [(comm, documents, kv_heads, None) for comm in ("p2p", "all_gather", "a2a")
         for documents in (False, True) for kv_heads in (4, 2)] + \
    [(comm, documents, 2, tile) for comm in ("p2p", "all_gather") for documents in (False, True)
     for tile in (32 * 2**20, 600)]


def test_attention_and_gradients_equal_serial_attention_at_every_cp(seed):
    per_rank = run_distributed(attention_errors, 4, seed, LAYOUTS, CASES, timeout=300)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(LAYOUTS) * len(CASES)
        for key, (errors, scale, positions_ok) in results.items():
            assert scale > 0.5, key  # values and gradients of random inputs, not zeros
            assert max(errors) < 1e-5 * scale, (rank, key, errors)
            assert positions_ok, key  # the layout's positions are Megatron's reset ones


def test_document_starts_and_positions_are_megatrons(seed):
    from megatron import mpu

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (3, 40), generator=generator)  # EOD = 0: many documents
    tokens[0, -1] = tokens[1, 0] = EOD  # a document ending last, one ending first
    allowed, positions = megatron_document_mask(tokens, EOD)
    starts = mpu.document_starts(tokens, EOD)
    s = tokens.shape[1]
    assert torch.equal(torch.arange(s) - starts, positions)
    layout = mpu.token_layout(positions, starts)
    assert torch.equal(mpu.dense_attention_mask(layout)[:, 0], ~allowed)
    causal = mpu.dense_attention_mask(mpu.token_layout(positions))
    assert torch.equal(causal[:, 0], torch.ones(s, s, dtype=torch.bool).triu(1).expand(3, s, s))
    assert mpu.is_token_layout(layout) and not mpu.is_token_layout(causal)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_chunks_are_load_balanced_and_every_step_does_equal_work(cp):
    from megatron.mpu import load_balanced_indices
    from megatron.mpu.ring_attention import step_plan

    m = 5
    owners = torch.cat([load_balanced_indices(2 * cp * m, r, cp) for r in range(cp)])
    assert torch.equal(owners.sort().values, torch.arange(2 * cp * m))  # a partition
    for rank in range(cp):
        mine = load_balanced_indices(2 * cp * m, rank, cp)
        seen = torch.zeros(2 * m, dtype=torch.long)  # keys each query sees over the steps
        for step in range(cp):
            src = (rank - step) % cp
            rows, cols, causal = step_plan(rank, src, m)
            theirs = load_balanced_indices(2 * cp * m, src, cp)
            visible = theirs[None, :] <= mine[:, None]  # the truth, key <= query
            assert causal or visible[rows][:, cols].all()  # a full block needs no mask
            assert visible.sum() == visible[rows][:, cols].sum()  # the block holds it all
            area = (rows.stop - rows.start) * (cols.stop - cols.start)
            assert area == (4 * m * m if src == rank else 2 * m * m)  # balanced
            seen += visible.sum(1)
        assert torch.equal(seen, mine + 1)  # every query saw exactly its past


def test_rotary_angles_at_given_positions_are_the_tables_rows(seed):
    from megatron import mpu

    rotary = mpu.RotaryEmbedding(8, 500.0)
    positions = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(seed))
    cos, sin = rotary.at_positions(positions)  # [s, b, 1, d]
    table_cos, table_sin = rotary(40)  # [40, 1, 1, d]
    assert torch.equal(cos, table_cos[positions.t(), 0]) and \
        torch.equal(sin, table_sin[positions.t(), 0])


def test_compiled_layer_breaks_only_at_the_context_parallel_attention(seed):
    from cp_runs import compiled_layer_breaks

    """The ring runs as one eager call (torch.compiler.disable): the layer's frame and the
    attention module's frame each split there, so dynamo counts 4 graphs and 3 breaks for
    the layer, every break at that call (a layer without context parallelism: 1 and 0)."""
    for graphs, breaks, reasons, same in run_distributed(compiled_layer_breaks, 2, seed,
                                                         timeout=300):
        assert (graphs, breaks) == (4, 3)
        assert reasons == {"context_parallel_attention"}, reasons
        assert same  # compiled equals eager, forward and backward
