"""What to type to run a planned layout: the run script's variables, or the flags.

tools/plan_layout.py prints, for its best rows, the line that starts that layout:

    GPUS_PER_NODE=8 NNODES=8 mp_size=2 cp_size=1 pp_size=4 vpp_size=1 PIPELINE_SCHEDULE=zbv
      BATCHSIZE=2 GAS=12 NLAYERS=40 ... PRECISION=fp16
      EXTRA_ARGS='--use-distributed-optimizer --overlap-grad-reduce --sequence-parallel'
      bash examples/run_gpt2.sh

for a family with a run script (GPT-2: examples/run_gpt2.sh, T5: examples/run_t5.sh), and
the training flags for any other (the config's settings as flags, then the layout's:
``--num-layers 32 ... --tensor-model-parallel-size 2 ...``). The run script passes its own
model, batch and schedule values as flags, so the line sets its variables from the
configuration; what has no variable (sequence parallelism, the distributed optimizer and the
overlapped reduction, DeepSpeed's ZeRO stage, selective recompute, a feed-forward width) goes
into ``EXTRA_ARGS``. The YAML itself is not passed:
its layout (a ``parallel_config``, ``sequence_parallel: true``, a recompute) would override
the row's where no flag turns it off. ``CHECK_ONLY=1`` in front of a run-script line checks
the settings without launching (examples/launch_common.sh).
"""
import shlex
from typing import Any, Dict, List, Optional

#: The run script of each family that has one (the repository-relative path).
RUN_SCRIPTS = {"gpt2": "examples/run_gpt2.sh", "t5": "examples/run_t5.sh"}

#: Run-script variable -> the flat run-configuration setting it passes (per script).
_MODEL_VARIABLES = {
    "gpt2": (("NLAYERS", "num_layers"), ("NHIDDEN", "hidden_size"),
             ("NHEADS", "num_attention_heads"), ("SEQLEN", "seq_length")),
    "t5": (("NLAYERS", "num_layers"), ("NHIDDEN", "hidden_size"),
           ("NHEADS", "num_attention_heads"), ("KV_HIDDEN", "kv_channels"),
           ("FF_HIDDEN", "ffn_hidden_size"), ("ENC_SEQLEN", "enc_seq_length"),
           ("DEC_SEQLEN", "dec_seq_length")),
}
#: Settings (dests) that make up a layout: the row's, never the YAML's.
LAYOUT_DESTS = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "cp_comm_type", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage", "pipeline_schedule", "micro_batch_size", "gas",
    "global_batch_size", "sequence_parallel", "checkpoint_activations",
    "checkpoint_num_layers", "recompute_granularity", "recompute_method",
    "recompute_num_layers", "recompute_activations", "zero_stage", "deepspeed",
    "use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
    "expected_data_parallel_size", "expert_model_parallel_size"})
#: The YAML's model settings a run-script line passes in EXTRA_ARGS (the scripts have no
#: variable for them); the rest of the script's run (optimizer, logging) is the script's.
SCRIPT_EXTRAS = ("ffn_hidden_size", "kv_channels", "make_vocab_size_divisible_by",
                 "t5_ff", "untie_embeddings", "relative_attention_num_buckets")


def _recompute_flags(spec: Any) -> List[str]:
    if spec.recompute == "selective":
        return ["--recompute-granularity", "selective"]
    if spec.recompute == "full":
        return ["--recompute-granularity", "full", "--recompute-method", spec.recompute_method,
                "--recompute-num-layers", str(spec.recompute_num_layers)]
    return []


def _step_flags(spec: Any) -> List[str]:
    """The project's step (``ddp``): its distributed optimizer (the planner's ZeRO 1) and the
    overlapped reduction; DeepSpeed's engine (pp 1): ``--deepspeed`` and ZeRO's stage (the
    JSON's would win otherwise)."""
    if spec.backend != "engine":
        return ((["--use-distributed-optimizer"] if spec.zero_stage else []) +
                (["--overlap-grad-reduce"] if getattr(spec, "overlap_grad_reduce", False)
                 else []))
    return ["--deepspeed", "--zero-stage", str(spec.zero_stage)]


def layout_flags(spec: Any) -> List[str]:
    """The training flags that give the layout of ``spec`` (a planned
    :class:`~megatron.memory.spec.MemorySpec`): parallel sizes, schedule, micro-batch and
    global batch, recompute, ZeRO, sequence parallelism.

    Args:
        spec: the layout (a row of the planner).
    """
    flags = ["--tensor-model-parallel-size", str(spec.tp),
             "--pipeline-model-parallel-size", str(spec.pp)]
    if spec.cp > 1:
        flags += ["--context-parallel-size", str(spec.cp), "--cp-comm-type", spec.cp_comm]
    if getattr(spec, "num_experts", 0):
        flags += ["--expert-model-parallel-size", str(spec.ep)]
    if spec.pp > 1:
        flags += ["--pipeline-schedule", spec.pipeline_schedule]
        if spec.vpp > 1:
            flags += ["--virtual-pipeline-model-parallel-size", str(spec.vpp)]
    flags += ["--micro-batch-size", str(spec.micro_batch), "--global-batch-size",
              str(spec.micro_batch * spec.num_micro_batches * spec.dp)]
    flags += _recompute_flags(spec) + _step_flags(spec)
    if spec.sequence_parallel:
        flags.append("--sequence-parallel")
    return flags


def _script_variables(spec: Any, family: str, settings: Dict[str, Any]) -> Dict[str, str]:
    """The variables of the family's run script for ``spec`` (layout, batch, model sizes,
    precision, dropout, attention, learning rate)."""
    out = {"mp_size": str(spec.tp)}
    if family == "gpt2":
        out["cp_size"] = str(spec.cp)
    if getattr(spec, "num_experts", 0):
        out["ep_size"] = str(spec.ep)
    out.update(pp_size=str(spec.pp), vpp_size=str(spec.vpp if spec.pp > 1 else 1))
    if spec.pp > 1:
        out["PIPELINE_SCHEDULE"] = spec.pipeline_schedule
    out.update(BATCHSIZE=str(spec.micro_batch), GAS=str(spec.num_micro_batches))
    for variable, key in _MODEL_VARIABLES[family]:
        if settings.get(key) is not None:
            out[variable] = str(settings[key])
    out["PRECISION"] = spec.dtype  # fp32 | fp16 | bf16: the script's names
    if spec.attention == "unfused":  # the script's auto would be SDPA
        out["ATTENTION_BACKEND"] = "unfused"
    for variable, key in (("HIDDEN_DROPOUT", "hidden_dropout"),
                          ("ATTENTION_DROPOUT", "attention_dropout")):
        if settings.get(key) is not None:
            out[variable] = f"{settings[key]:g}"
    if settings.get("lr") is not None:
        out["LR"] = f"{settings['lr']:g}"
    if spec.backend == "engine" and spec.pp == 1:
        out["USE_DEEPSPEED"] = "1"
    if _checkpoint_activations(spec):
        out["RECOMPUTE"] = "1"
    return out


def _checkpoint_activations(spec: Any) -> bool:
    """Full recompute of uniform groups of one layer: the run scripts' ``RECOMPUTE=1``
    (``--checkpoint-activations``)."""
    return spec.recompute == "full" and (spec.recompute_method,
                                         spec.recompute_num_layers) == ("uniform", 1)


def _extra_args(spec: Any, family: str, config_flags: Dict[str, List[str]]) -> List[str]:
    """What the run script has no variable for."""
    covered = {key for _, key in _MODEL_VARIABLES[family]}
    extra = [w for dest in SCRIPT_EXTRAS if dest not in covered
             for w in config_flags.get(dest, [])]
    if spec.cp > 1 and spec.cp_comm != "p2p":
        extra += ["--cp-comm-type", spec.cp_comm]
    if not _checkpoint_activations(spec):
        extra += _recompute_flags(spec)
    if spec.backend == "engine":
        extra += ["--zero-stage", str(spec.zero_stage)]
    else:
        extra += _step_flags(spec)
    if spec.sequence_parallel:
        extra.append("--sequence-parallel")
    return extra


def run_line(spec: Any, family: str, nodes: int, settings: Dict[str, Any],
             config_flags: Optional[Dict[str, List[str]]] = None) -> str:
    """The line that starts the layout ``spec``: the run script's variables for a family with
    one (:data:`RUN_SCRIPTS`), else the training flags (for the family's entry script).

    Args:
        spec: the layout (a planner row).
        family: the model family's name.
        nodes: nodes of the plan (GPUs per node = world / nodes).
        settings: the run configuration's flat values (``RunConfig.to_dict()``): model
            sizes, dropout and learning rate the run script would otherwise set to its own.
        config_flags: the YAML's settings as words by dest
            (:func:`megatron.config.config_file_flags`); its layout ones are left out.
    """
    config_flags = config_flags or {}
    if family not in RUN_SCRIPTS:
        flags = [w for dest, words in config_flags.items() if dest not in LAYOUT_DESTS
                 for w in words] + layout_flags(spec)
        return (f"{spec.world // nodes} processes on each of {nodes} node(s): "
                + " ".join(shlex.quote(f) for f in flags))
    variables = {"GPUS_PER_NODE": str(spec.world // nodes), "NNODES": str(nodes),
                 **_script_variables(spec, family, settings)}
    extra = _extra_args(spec, family, config_flags)
    words = [f"{k}={v}" for k, v in variables.items()]
    if extra:
        words.append("EXTRA_ARGS=" + shlex.quote(" ".join(extra)))
    return " ".join(words + ["bash", RUN_SCRIPTS[family]])
