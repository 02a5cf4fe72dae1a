"""Rank bodies for the BERT example's tests (examples/bert/bert_model.py,
tests/test_bert_example.py)."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples", "bert"))
sys.path.insert(0, os.path.join(REPO, "tools"))

#: the autograd fallback's warning every pp > 1 run printed before issue 45
AUTOGRAD_WARNING = "an autograd kernel was not registered"
VOCAB = 100  # the random transformers model's vocabulary


def bert_argv(data, tp, pp, *extra, vpp=1, steps=8, micro=2, global_batch=8):
    """Flags for a dropout-free 4-layer BERT run at (tp, pp, v) (dp = what is left); 30 %
    of the positions masked, so each micro-batch has some; evaluated at step 8."""
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--ffn-hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32",
            "--data-path", data["prefix"], "--vocab-file", data["vocab"],
            "--merge-file", data["merges"], "--split", "98,2,0",
            "--make-vocab-size-divisible-by", "64", "--lr", "5e-3", "--min-lr", "5e-4",
            "--warmup", "2", "--log-interval", "4", "--eval-interval", "8",
            "--eval-iters", "1", "--seed", "1234", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--mask-prob", "0.3",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            *(["--virtual-pipeline-model-parallel-size", str(vpp)] if vpp > 1 else []),
            "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch),
            "--train-iters", str(steps), *extra]


def train_bert(argv, family=None):
    """Rank body: pretrain the example (or ``family``); the per-step losses, then the
    validation losses (one, at step 8)."""
    from bert_model import BERT
    from megatron.training import pretrain

    state = pretrain(family=family or BERT, argv=argv)
    return state.losses + [loss for _, loss in state.eval_losses]


def old_api_family():
    """The example's family built as a family was written before ``ModelFamily.supports``
    existed (the fields of megatron/families/base.py at 0dd1410^: no ``supports``,
    ``compile_classes``, ``checked_settings``, ``memory_model`` nor ``hf_names``), its
    ``build_model`` as such code wrote it (no placement)."""
    import bert_model as b
    from megatron.families import ModelFamily, decoder_lm

    def build_model(cfg, pipeline):
        config = b.model_config(cfg)
        return b.pipeline_model(config, cfg.parallel.vpp) if pipeline else b.serial_model(config)

    return ModelFamily(name="bert", add_flags=b.add_flags, model_config=b.model_config,
                       build_model=build_model, build_datasets=decoder_lm.build_datasets,
                       flops_per_step=b.flops_per_step, make_batch_fn=b.make_batch_fn,
                       loss_fn=b.mlm_loss, flag_defaults=dict(b.BERT.flag_defaults),
                       label="BERT", validate=b.validate)


def _inputs(seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)  # [b, s]
    return tokens, torch.randint(0, 2, (2, 16), generator=g)


def _ours(model, tokens, types, vocab):
    """Our logits, the whole vocabulary gathered, the real rows: ``[b, s, vocab]``."""
    import torch

    from megatron import mpu

    padding = torch.zeros(tokens.shape[0], 1, 1, tokens.shape[1], dtype=torch.bool)
    logits = model(tokens, types, padding)  # [b, s, v/tp]
    return mpu.gather_from_tensor_model_parallel_region(logits.contiguous())[..., :vocab]


def _model_from(root, tp):
    """Our serial model at ``tp`` holding the native checkpoint ``root`` (any layout; its
    latest iteration), cut by its record."""
    from bert_model import BERT, serial_model
    from megatron import mpu
    from megatron.checkpoint.native_reader import read_native
    from megatron.checkpoint.sharding import sharding_record, slice_recorded

    full = read_native(root)  # whole tensors, the real vocabulary rows
    model = serial_model(BERT.config_from_saved(full.args)).eval()
    model.load_state_dict(slice_recorded(full.state, sharding_record(model), tp,
                                         mpu.get_tensor_model_parallel_rank(),
                                         full.args["padded_vocab_size"], root))
    return model


def hf_logit_errors(from_hf, to_hf, seed):
    """``{(direction, tp): (largest |logit difference|, logit scale)}`` at tp 1 and 2:
    ``from_hf``: ``{tp: native checkpoint converted from a random BertForMaskedLM}`` against
    that model (its directory: ``from_hf["hf"]``); ``to_hf``: ``(native checkpoint, its HF
    export)``, our model from the checkpoint against transformers' from the export."""
    import torch
    from transformers import BertForMaskedLM

    from megatron import mpu

    tokens, types = _inputs(seed)
    out = {}
    for tp in (1, 2):
        if mpu.model_parallel_is_initialized():  # left by pretrain()
            mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(tp, 1)
        with torch.no_grad():
            for name, ours, theirs in (("from hf", from_hf[tp], from_hf["hf"]),
                                       ("to hf", to_hf[0], to_hf[1])):
                hf = BertForMaskedLM.from_pretrained(theirs).eval()
                reference = hf(input_ids=tokens, token_type_ids=types).logits
                mine = _ours(_model_from(ours, tp), tokens, types, reference.shape[-1])
                out[(name, tp)] = ((mine - reference).abs().max().item(),
                                   reference.abs().max().item())
        mpu.destroy_model_parallel()
    return out


def _whole(module):
    """``module``'s whole tensors (every tensor-parallel rank's shards, by their record)."""
    import torch.distributed as dist

    from megatron import mpu
    from megatron.checkpoint.sharding import merge_recorded, sharding_record

    every = [None] * mpu.get_tensor_model_parallel_world_size()
    dist.all_gather_object(every, (module.state_dict(), sharding_record(module)),
                           group=mpu.get_tensor_model_parallel_group())
    return merge_recorded({(t, 0): sd for t, (sd, _) in enumerate(every)},
                          {(t, 0): rec for t, (_, rec) in enumerate(every)}, None, "heads")


def _masked(logits, true_vocab):
    logits = logits.clone()
    logits[..., true_vocab:] = float("-inf")
    return logits


def heads_against_plain_torch(seed):
    """Rank body (tp 2): megatron.model.lm_head's heads against F.linear / F.embedding on
    their whole weights, with and without sequence parallelism: ``{case: largest
    difference}`` (padded vocabulary columns must be -inf in both), and the records."""
    import torch
    import torch.nn.functional as F

    from megatron import mpu
    from megatron.checkpoint.sharding import sharding_record
    from megatron.model.lm_head import OutputLayer, VocabParallelBias, WordEmbedding, tied_logits

    mpu.initialize_model_parallel(2, 1)
    torch.manual_seed(seed)  # the same tensors on both ranks
    s, b, h, vocab, true = 6, 2, 8, 16, 13
    hidden, tokens = torch.randn(s, b, h), torch.randint(0, true, (b, s))
    shard = hidden.chunk(2)[mpu.get_tensor_model_parallel_rank()]  # [s/tp, b, h]
    out, records = {}, {}
    for sp in (False, True):
        x = shard if sp else hidden
        untied = OutputLayer(h, vocab, bias=True, seed=seed, true_vocab_size=true,
                             sequence_parallel=sp)
        tied, bias = WordEmbedding(vocab, h, seed=seed, true_vocab_size=true,
                                   sequence_parallel=sp), VocabParallelBias(vocab)
        with torch.no_grad():
            untied.linear.bias.normal_()
            bias.bias.normal_()
        w = _whole(untied)
        e, bb = _whole(tied)["word_embeddings.weight"], _whole(bias)["bias"]
        cases = {"untied": (untied(x), F.linear(hidden, w["linear.weight"], w["linear.bias"])),
                 "tied": (bias(tied_logits(tied, x)), F.linear(hidden, e) + bb)}
        for name, (ours, plain) in cases.items():
            ours = mpu.gather_from_tensor_model_parallel_region(ours.contiguous())  # [b, s, v]
            plain = _masked(plain.transpose(0, 1), true)
            same_inf = torch.equal(torch.isinf(ours), torch.isinf(plain))
            finite = torch.isfinite(plain)
            out[(name, sp)] = (ours[finite] - plain[finite]).abs().max().item() \
                if same_inf else float("inf")
        out[("lookup", sp)] = (tied.lookup(tokens) - F.embedding(tokens, e)).abs().max().item()
        records = {**sharding_record(untied), **sharding_record(bias)}
    mpu.destroy_model_parallel()
    return out, records


def _export(ckpt, out):
    """Rank 0 converts ``ckpt`` to an HF directory (the tool's main, in this process)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        import convert_checkpoint

        convert_checkpoint.main.__wrapped__(["--family", BERT_SPEC, "--input", ckpt,
                                             "--output", out, "--output-format", "hf"])
    dist.barrier()


BERT_SPEC = os.path.join(REPO, "examples", "bert", "bert_model.py") + ":BERT"


def pipelines(data, ck):
    """Rank body (2 ranks): the example at pp 2 for 8 steps, 1F1B (through the older API's
    family, with recompute, saving at step 4), interleaved (v 2) and ZB-V; the warnings the
    runs raised."""
    import warnings

    runs = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs["pp2 1f1b"] = train_bert(bert_argv(data, 1, 2, "--checkpoint-activations",
                                                "--save", f"{ck}/pp2", "--save-interval", "4"),
                                      old_api_family())
        runs["pp2 v2"] = train_bert(bert_argv(data, 1, 2, vpp=2))
        runs["pp2 zbv"] = train_bert(bert_argv(data, 1, 2, "--pipeline-schedule", "zbv", vpp=2))
    return runs, sorted({str(w.message)[:200] for w in caught})


def tensor_parallel_and_hf(data, ck, from_hf, seed):
    """Rank body (2 ranks): the example at tp 2 with sequence parallelism for 4 steps, saving
    there; the HF logit errors (:func:`hf_logit_errors`: ``from_hf``, and the export of that
    checkpoint); the heads against plain torch (:func:`heads_against_plain_torch`)."""
    losses = train_bert(bert_argv(data, 2, 1, "--sequence-parallel", "--save", f"{ck}/tp2",
                                  "--save-interval", "4", "--exit-interval", "4"))
    _export(f"{ck}/tp2", f"{ck}/tp2_hf")
    errors = hf_logit_errors(from_hf, (f"{ck}/tp2", f"{ck}/tp2_hf"), seed)
    return losses, errors, heads_against_plain_torch(seed)


def serial_and_resumes(data, loads):
    """Rank body (1 rank): the serial run (8 steps), and one run per ``{name: flags}`` of
    ``loads`` (``--load`` of a step-4 checkpoint: steps 5-8)."""
    runs = {"serial": train_bert(bert_argv(data, 1, 1))}
    for name, flags in loads.items():
        runs[name] = train_bert(bert_argv(data, 1, 1, *flags))
    return runs
