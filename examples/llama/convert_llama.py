"""Convert the Llama example to and from a Hugging Face ``LlamaForCausalLM`` directory.

    # a checkpoint saved at any (tp, pp, v) -> a directory from_pretrained loads
    python examples/llama/convert_llama.py --load CHECKPOINT_DIR --output HF_DIR [--iteration N]

    # a LlamaForCausalLM directory -> a native checkpoint at a given layout
    python examples/llama/convert_llama.py --from-hf HF_DIR --output CHECKPOINT_DIR \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        [--virtual-pipeline-model-parallel-size 2] [--pipeline-schedule zbv] \\
        [--make-vocab-size-divisible-by 128]

To HF: the checkpoint's tensors are merged by the sharding it records (no key map), then
renamed by :func:`llama_model.to_hf`. From HF: the tensors are renamed by
:func:`llama_model.from_hf`, the vocabulary padded as a training run at that layout pads it,
and each rank file cut by the sharding record of the example's layers at that layout (which
stage and chunk holds each layer: the pipeline's own partition), which the files carry on.
The result holds weights only (iteration 0): train from it with ``--load CHECKPOINT_DIR
--finetune`` and the flags the converter prints; any other layout resumes from it as from a
checkpoint of its own (``--load`` reads the record).

Both directions write as the project's converters do: into a temporary folder, every file
flushed to disk, then renamed into place and its parent flushed (the tracker last, for a
native checkpoint), so a killed conversion or a crashed node never leaves a half output.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # llama_model, megatron

from megatron.common.errors import run_main  # noqa: E402


def export_hf(load: str, output: str, iteration=None):
    """Write ``load`` (a native checkpoint of the example) to ``output`` as an HF directory.

    Args:
        load: the ``--save`` directory of a run.
        output: the directory to write (``config.json`` and the weights).
        iteration: which saved iteration (default: the tracker's).
    """
    from transformers import LlamaForCausalLM

    from llama_model import LLAMA, hf_config, to_hf
    from megatron.checkpoint.native_reader import read_native
    from megatron.checkpoint_conversion.hf_io import write_hf_dir

    full = read_native(load, iteration, family="llama")
    config = LLAMA.config_from_saved(full.args)
    model = LlamaForCausalLM(hf_config(config, full.args.get("max_position_embeddings", 2048)))
    model.load_state_dict(to_hf(full.state, config))  # HF's names and shapes, checked
    # what save_pretrained writes (config, generation config, safetensors weights), durably
    model.config.architectures = [type(model).__name__]
    extra = {"generation_config.json": json.loads(model.generation_config.to_json_string())} \
        if model.generation_config is not None else None
    write_hf_dir(output, json.loads(model.config.to_json_string()),
                 {k: v.detach() for k, v in model.state_dict().items()}, extra_json=extra)
    return model


def _record_of_layers(config) -> dict:
    """``{key: [tp_dim, stride, vocab_rows]}`` of the example's tensors, read from the mpu
    layers' attributes of a tiny model with the same layers (built at tp = 1 through mpu's
    v2.6 setters, without a process group)."""
    import dataclasses

    from llama_model import LlamaModel
    from megatron import mpu
    from megatron.checkpoint.sharding import sharding_record

    heads, kv = config.num_attention_heads, config.num_key_value_heads
    tiny = dataclasses.replace(config, hidden_size=2 * heads, ffn_hidden_size=1, vocab_size=1,
                               true_vocab_size=None, sequence_parallel=False,
                               checkpoint_activations=False, num_key_value_heads=kv, fp8=None)
    mpu.set_tensor_model_parallel_world_size(1)
    mpu.set_tensor_model_parallel_rank(0)
    try:
        return {k: v[:3] for k, v in sharding_record(LlamaModel(tiny)).items()}
    finally:
        mpu.set_tensor_model_parallel_world_size(None)
        mpu.set_tensor_model_parallel_rank(None)


def layout_records(config, pp: int, vpp: int = 1, placement: str = "loop") -> dict:
    """``{pp_rank: sharding record}`` of the example at ``pp`` stages of ``vpp`` chunks: what
    each rank's model holds (its layer specs, partitioned as the pipeline partitions them,
    ``type:LlamaLayer``) and how each tensor is split (:mod:`megatron.checkpoint.sharding`).

    Args:
        config: the model's :class:`llama_model.LlamaConfig`.
        pp, vpp: pipeline ranks and chunks per rank.
        placement: "loop" (interleaved) or "v" (ZB-V).
    """
    base = _record_of_layers(config)
    if pp == 1:
        return {0: {k: spec + [0, 0] for k, spec in base.items()}}
    from deepspeed.runtime.utils import partition_balanced

    from megatron.checkpoint.chunks import rank_bounds, spec_indices

    weights = [0] + [1] * config.num_layers + [0, 0]  # embedding, layers, norm, head
    parts = [int(x) for x in partition_balanced(weights, pp * vpp)]
    chunk_of = {i: c for c in range(pp * vpp) for i in range(parts[c], parts[c + 1])}
    records = {}
    for rank, bounds in enumerate(rank_bounds(weights, pp, vpp, placement)):
        specs = spec_indices(bounds)
        records[rank] = {k: spec + [rank, chunk_of[int(k.split(".", 1)[0])]]
                         for k, spec in base.items() if int(k.split(".", 1)[0]) in specs}
    return records


def _check_layout(config, tp, pp, vpp, schedule):
    from megatron.common.errors import ConfigError

    problems = [f"--{what} must be >= 1" for what, n in (("tensor-model-parallel-size", tp),
                ("pipeline-model-parallel-size", pp), ("virtual-pipeline-model-parallel-size",
                                                       vpp)) if n < 1]
    problems += [f"{what} ({n}) is not divisible by --tensor-model-parallel-size {tp}"
                 for what, n in (("num_key_value_heads", config.num_key_value_heads),
                                 ("num_attention_heads", config.num_attention_heads),
                                 ("intermediate_size", config.ffn_hidden_size)) if tp and n % tp]
    if pp * vpp > config.num_layers:
        problems.append(f"{pp} stages x {vpp} chunks need at least {pp * vpp} layers, the "
                        f"model has {config.num_layers}")
    if vpp > 1 and pp < 2:
        problems.append("--virtual-pipeline-model-parallel-size > 1 needs "
                        "--pipeline-model-parallel-size >= 2")
    if schedule == "zbv" and vpp != 2:
        problems.append("--pipeline-schedule zbv places two chunks per rank: pass "
                        "--virtual-pipeline-model-parallel-size 2")
    if problems:
        raise ConfigError("; ".join(problems))


def _saved_args(config, hf, tp, pp, vpp, schedule, divisible_by):
    """The saved args a run of the example at this layout would write (its model settings)."""
    return {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "ffn_hidden_size": config.ffn_hidden_size, "rope_theta": config.rope_theta,
            "layernorm_epsilon": config.norm_eps, "init_method_std": config.init_method_std,
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            "padded_vocab_size": config.vocab_size, "true_vocab_size": config.true_vocab_size,
            "make_vocab_size_divisible_by": divisible_by,
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": vpp,
            "pipeline_schedule": schedule or ("interleaved" if vpp > 1 else "1f1b")}


def import_hf(hf_dir: str, output: str, tp: int = 1, pp: int = 1, vpp: int = 1,
              schedule: str = "", divisible_by: int = 128) -> str:
    """Write the ``LlamaForCausalLM`` directory ``hf_dir`` as a native checkpoint of the
    example at (``tp``, ``pp``, ``vpp``) under ``output`` (iteration 0, weights only).

    Args:
        hf_dir: a ``save_pretrained`` directory (safetensors or .bin, sharded or not).
        output: the ``--load`` directory to write.
        tp, pp, vpp: the target layout (``vpp`` chunks per pipeline rank).
        schedule: the run's ``--pipeline-schedule`` ("zbv": the V placement; default 1f1b,
            or interleaved when ``vpp`` > 1).
        divisible_by: the run's ``--make-vocab-size-divisible-by``.

    Returns:
        The iteration folder written.
    """
    from llama_model import config_from_hf, from_hf
    from megatron.checkpoint.native_reader import FullCheckpoint
    from megatron.checkpoint.native_writer import reshard, write_native
    from megatron.checkpoint_conversion import hf_io
    from megatron.tokenizer import vocab_size_with_padding

    hf = hf_io.read_config(hf_dir)
    config = config_from_hf(hf, vocab_size_with_padding(hf["vocab_size"], divisible_by,
                                                        max(tp, 1)))
    _check_layout(config, tp, pp, vpp, schedule)
    state = hf_io.read_weights(hf_dir)
    if "lm_head.weight" not in state and hf.get("tie_word_embeddings"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # untied from here on
    full = FullCheckpoint(from_hf(state, config),
                          _saved_args(config, hf, tp, pp, vpp, schedule, divisible_by),
                          iteration=0, stage_records=layout_records(
                              config, pp, vpp, "v" if schedule == "zbv" else "loop"),
                          family="llama")
    # the vocabulary rows padded for tp (new rows zero: their logits are masked), checked
    full = reshard(full, tp, pp, divisible_by, config.true_vocab_size)
    return write_native(full, output, tp, pp, source=f"hf:{os.path.abspath(hf_dir)}")


def training_flags(args: dict) -> str:
    """The model flags a run loading the converted checkpoint must give."""
    flags = [("--num-layers", args["num_layers"]), ("--hidden-size", args["hidden_size"]),
             ("--num-attention-heads", args["num_attention_heads"]),
             ("--num-key-value-heads", args["num_key_value_heads"]),
             ("--ffn-hidden-size", args["ffn_hidden_size"]),
             ("--max-position-embeddings", args["max_position_embeddings"]),
             ("--rope-theta", args["rope_theta"]),
             ("--layernorm-epsilon", args["layernorm_epsilon"]),
             ("--make-vocab-size-divisible-by", args["make_vocab_size_divisible_by"])]
    return " ".join(f"{flag} {value}" for flag, value in flags)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="native checkpoint -> HF directory")
    source.add_argument("--from-hf", help="HF LlamaForCausalLM directory -> native checkpoint")
    p.add_argument("--output", required=True)
    p.add_argument("--iteration", type=int, default=None, help="--load: which iteration")
    g = p.add_argument_group("--from-hf: the target layout (the training run's flags)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-schedule", choices=["1f1b", "interleaved", "zb-h1", "zbv"],
                   default="")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    args = p.parse_args(argv)
    if args.load:
        export_hf(args.load, args.output, args.iteration)
        print(f"> wrote {args.output}")
        return 0
    folder = import_hf(args.from_hf, args.output, args.tensor_model_parallel_size,
                       args.pipeline_model_parallel_size,
                       args.virtual_pipeline_model_parallel_size, args.pipeline_schedule,
                       args.make_vocab_size_divisible_by)
    from megatron.checkpoint.format import load_rank_file, rank_files

    saved = load_rank_file(rank_files(folder)[(0, 0)])["args"]
    print(f"> wrote {folder}; train from it with --load {args.output} --finetune "
          f"{training_flags(saved)} (and this layout, or any other)")
    return 0


if __name__ == "__main__":
    run_main(main)
