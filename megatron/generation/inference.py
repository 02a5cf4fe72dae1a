"""Models for generation from a checkpoint of any layout (native or Hugging Face).

The model runs at this process group's tensor-parallel size (pp must be 1). A GPT-2
checkpoint saved at that same tp without pipeline stages is loaded file by file; any other
layout is merged and resharded in memory (:mod:`megatron.checkpoint`), so a pipeline run's
checkpoint or one of another tp generates without converting it first.
"""
from .. import mpu
from ..checkpoint import gpt2_keys
from ..checkpoint.format import (checkpoint_name, iteration_dir, load_rank_file, rank_files,
                                resolve_iteration)
from ..checkpoint.native_reader import read_native
from ..checkpoint.native_writer import reshard, stage_state
from ..checkpoint_conversion import hf_io, t5_hf
from ..common.errors import CheckpointError, ConfigError
from ..families import get_family


def _own_weights(root, iteration, true_vocab):
    """(this rank's GPT2Model state dict, effective args) for the current tp."""
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), \
        mpu.get_tensor_model_parallel_rank()
    files = rank_files(iteration_dir(root, iteration))
    head = load_rank_file(files.get((0, 0), checkpoint_name(root, iteration, 0, 0)))
    args = head.get("args") or {}
    same_layout = (args.get("tensor_model_parallel_size") == tp
                   and args.get("pipeline_model_parallel_size", 1) == 1
                   and not gpt2_keys.is_pipe_state(head.get("model", {})))
    if same_layout and set(files) == {(t, 0) for t in range(tp)}:
        state = head if tp_rank == 0 else load_rank_file(files[(tp_rank, 0)])
        return state["model"], args
    full = read_native(root, iteration)
    target = reshard(full, tp, 1, true_vocab=true_vocab)
    return stage_state(target.state, target.args, tp_rank), target.args


def load_gpt2_for_inference(root, iteration=None, true_vocab=None):
    """GPT2Model (eval mode, gathered logits) with a checkpoint's weights.

    Every tensor-parallel rank calls it (it builds tensor-parallel layers).

    Args:
        root: a native checkpoint directory (``--save`` of a run or a conversion).
        iteration: which iteration (default: the tracker's).
        true_vocab: real vocabulary rows, needed only when the checkpoint's tp differs
            from this run's and its tokenizer files are gone.

    Returns:
        ``(model, args)``: the model and the saved args (with this layout's padded size).
    """
    from ..model.gpt2_model import GPT2Model

    if mpu.get_pipeline_model_parallel_world_size() != 1:
        raise ConfigError("generation runs without pipeline stages; launch tp processes only")
    iteration = resolve_iteration(root, iteration)
    state, args = _own_weights(root, iteration, true_vocab)
    heads, tp = args["num_attention_heads"], mpu.get_tensor_model_parallel_world_size()
    if heads % tp:
        raise ConfigError(f"the model's {heads} attention heads do not divide by the "
                          f"{tp} processes launched; launch a divisor of {heads}")
    model = GPT2Model(get_family("gpt2").config_from_saved(args), args["padded_vocab_size"],
                      args["max_position_embeddings"], parallel_output=False)
    _load_weights(model, state, root)
    return model.eval(), args


def load_t5_for_inference(source, iteration=None, true_vocab=None):
    """T5Model (eval, gathered logits) with the weights of a native or HF checkpoint.

    Every tensor-parallel rank calls it; the model runs at this group's tp (pp must be 1).
    Any layout is merged and resharded in memory.

    Args:
        source: a native ``--save`` directory or an HF ``save_pretrained`` directory.
        iteration: native: which iteration (default: latest).
        true_vocab: real vocabulary rows, if needed to re-pad and unknown otherwise.

    Returns:
        ``(model, args)`` with the args of this layout (``padded_vocab_size``, sizes).
    """
    from ..model.t5_model import T5Model

    if mpu.get_pipeline_model_parallel_world_size() != 1:
        raise ConfigError("T5 inference runs without pipeline stages; launch tp processes only")
    full = t5_hf.read_hf(source) if hf_io.is_hf_dir(source) else \
        read_native(source, iteration, family="t5")
    tp = mpu.get_tensor_model_parallel_world_size()
    target = reshard(full, tp, 1, true_vocab=true_vocab)
    model = T5Model(get_family("t5").config_from_saved(target.args), parallel_output=False)
    state = stage_state(target.state, target.args, mpu.get_tensor_model_parallel_rank())
    _load_weights(model, state, source)
    return model.eval(), target.args


def _load_weights(model, state, source):
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint {source} does not fit the model its args describe: "
                              f"{str(exc).splitlines()[0]}") from None
