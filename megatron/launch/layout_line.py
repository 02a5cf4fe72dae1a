"""What to type to run a planned layout: the run script's variables, or the flags.

tools/plan_layout.py prints, for its best rows, the line that starts that layout:

    GPUS_PER_NODE=8 NNODES=8 mp_size=2 cp_size=1 pp_size=4 vpp_size=1 PIPELINE_SCHEDULE=zbv
      BATCHSIZE=2 GAS=12 NLAYERS=40 ... PRECISION=fp16
      EXTRA_ARGS="--config configs/gpt2/gpt2_13b.yaml --sequence-parallel --zero-stage 1"
      bash examples/run_gpt2.sh

for a family with a run script (GPT-2: examples/run_gpt2.sh, T5: examples/run_t5.sh), and
the training flags for any other (``--tensor-model-parallel-size 2 ...``). The run script
passes its model and batch variables as flags, which win over the YAML's values, so the
line sets them from the configuration; what has no variable (sequence parallelism, the ZeRO
stage, selective recompute) goes into ``EXTRA_ARGS`` with ``--config``, which carries the
rest of the YAML. ``CHECK_ONLY=1`` in front of the line checks the settings without
launching (examples/launch_common.sh).
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
_PRECISION = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}


def _recompute_flags(spec: Any) -> List[str]:
    if spec.recompute == "selective":
        return ["--recompute-granularity", "selective"]
    if spec.recompute == "full":
        return ["--recompute-granularity", "full", "--recompute-method", spec.recompute_method,
                "--recompute-num-layers", str(spec.recompute_num_layers)]
    return []


def _engine_flags(spec: Any) -> List[str]:
    """ZeRO's stage where the layout trains through DeepSpeed (the JSON's would win
    otherwise), and ``--deepspeed`` where that is not implied by a pipeline."""
    if spec.backend != "engine":
        return []
    return (["--deepspeed"] if spec.pp == 1 else []) + ["--zero-stage", str(spec.zero_stage)]


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
    if spec.pp > 1:
        flags += ["--pipeline-schedule", spec.pipeline_schedule]
        if spec.vpp > 1:
            flags += ["--virtual-pipeline-model-parallel-size", str(spec.vpp)]
    flags += ["--micro-batch-size", str(spec.micro_batch), "--global-batch-size",
              str(spec.micro_batch * spec.num_micro_batches * spec.dp)]
    flags += _recompute_flags(spec) + _engine_flags(spec)
    if spec.sequence_parallel:
        flags.append("--sequence-parallel")
    return flags


def _script_variables(spec: Any, family: str, settings: Dict[str, Any]) -> Dict[str, str]:
    """The variables of the family's run script for ``spec`` (layout, batch, model sizes,
    precision, dropout, attention, learning rate)."""
    out = {"mp_size": str(spec.tp)}
    if family == "gpt2":
        out["cp_size"] = str(spec.cp)
    out.update(pp_size=str(spec.pp), vpp_size=str(spec.vpp if spec.pp > 1 else 1))
    if spec.pp > 1:
        out["PIPELINE_SCHEDULE"] = spec.pipeline_schedule
    out.update(BATCHSIZE=str(spec.micro_batch), GAS=str(spec.num_micro_batches))
    for variable, key in _MODEL_VARIABLES[family]:
        if settings.get(key) is not None:
            out[variable] = str(settings[key])
    out["PRECISION"] = _PRECISION[spec.dtype]
    out["ATTENTION_BACKEND"] = "unfused" if spec.attention == "unfused" else "auto"
    for variable, key in (("HIDDEN_DROPOUT", "hidden_dropout"),
                          ("ATTENTION_DROPOUT", "attention_dropout")):
        if settings.get(key) is not None:
            out[variable] = f"{settings[key]:g}"
    if settings.get("lr") is not None:
        out["LR"] = f"{settings['lr']:g}"
    if spec.backend == "engine" and spec.pp == 1:
        out["USE_DEEPSPEED"] = "1"
    return out


def _extra_args(spec: Any, config: Optional[str]) -> List[str]:
    """What the run script has no variable for."""
    extra = ["--config", config] if config else []
    if spec.cp > 1 and spec.cp_comm != "p2p":
        extra += ["--cp-comm-type", spec.cp_comm]
    extra += _recompute_flags(spec)
    if spec.backend == "engine":
        extra += ["--zero-stage", str(spec.zero_stage)]
    if spec.sequence_parallel:
        extra.append("--sequence-parallel")
    return extra


def run_line(spec: Any, family: str, nodes: int, settings: Dict[str, Any],
             config: Optional[str] = None) -> str:
    """The line that starts the layout ``spec``: the run script's variables for a family with
    one (:data:`RUN_SCRIPTS`), else its training flags (for the family's entry script).

    Args:
        spec: the layout (a planner row).
        family: the model family's name.
        nodes: nodes of the plan (GPUs per node = world / nodes).
        settings: the run configuration's flat values (``RunConfig.to_dict()``): model
            sizes, dropout and learning rate the run script would otherwise set to its own.
        config: the YAML the plan was made from (passed on in ``--config``), or None.
    """
    if family not in RUN_SCRIPTS:
        flags = layout_flags(spec) + (["--config", config] if config else [])
        return (f"{spec.world // nodes} processes on each of {nodes} node(s): "
                + " ".join(shlex.quote(f) for f in flags))
    variables = {"GPUS_PER_NODE": str(spec.world // nodes), "NNODES": str(nodes),
                 **_script_variables(spec, family, settings)}
    if spec.recompute == "full" and (spec.recompute_method, spec.recompute_num_layers) == \
            ("uniform", 1):
        variables["RECOMPUTE"] = "1"
    extra = _extra_args(spec, config)
    if "RECOMPUTE" in variables:  # --checkpoint-activations: full, uniform, 1 layer
        extra = _without_recompute(extra, spec)
    words = [f"{k}={v}" for k, v in variables.items()]
    if extra:
        words.append("EXTRA_ARGS=" + shlex.quote(" ".join(extra)))
    return " ".join(words + ["bash", RUN_SCRIPTS[family]])


def _without_recompute(extra: List[str], spec: Any) -> List[str]:
    """``extra`` less the recompute flags (``RECOMPUTE=1`` passes them)."""
    drop = _recompute_flags(spec)
    for i in range(len(extra) - len(drop) + 1):
        if extra[i:i + len(drop)] == drop:
            return extra[:i] + extra[i + len(drop):]
    return extra
