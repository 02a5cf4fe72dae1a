"""Hugging Face GPT-2 (``GPT2LMHeadModel``) <-> full GPT2Model state dict and args: the GPT-2
family's HF adapter (:func:`read_hf`, :func:`write_hf`).

Differences bridged here (everything else maps one to one):

- HF's ``Conv1D`` stores weights ``[in, out]`` (``y = x W + b``); our linears store
  ``[out, in]``: every projection weight is transposed.
- HF's ``c_attn`` output is ``[q_all | k_all | v_all]``, each ``[heads, head_dim]``; our fused
  QKV is per head, ``[heads, (q, k, v), head_dim]``, so a contiguous tensor-parallel split
  gives whole heads. Weight rows and bias entries are permuted accordingly.
- HF ties ``lm_head.weight`` to ``wte``; so does GPT2Model (logits against the word embedding).
- The vocabulary is padded here (zero rows, see :mod:`.vocab_padding`); HF keeps the real rows.

Not representable in HF GPT-2 (rejected with an error): a per-head size other than
hidden / heads, linear layers without biases, and HF activations other than tanh-GeLU.
"""
import os

from ..checkpoint.native_reader import FullCheckpoint
from ..checkpoint.vocab_padding import resolve_true_vocab_size, tokenizer_from_args
from ..common.errors import CheckpointError, ConfigError
from . import hf_io

#: HF activation names that are GeLU's tanh approximation, which GPT2Model uses.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old HF files

_LAYER_MAP = {  # HF name -> (our name, transpose)
    "ln_1.weight": ("input_layernorm.weight", False),
    "ln_1.bias": ("input_layernorm.bias", False),
    "attn.c_attn.weight": ("attention.query_key_value.weight", True),
    "attn.c_attn.bias": ("attention.query_key_value.bias", False),
    "attn.c_proj.weight": ("attention.dense.weight", True),
    "attn.c_proj.bias": ("attention.dense.bias", False),
    "ln_2.weight": ("post_attention_layernorm.weight", False),
    "ln_2.bias": ("post_attention_layernorm.bias", False),
    "mlp.c_fc.weight": ("mlp.dense_h_to_4h.weight", True),
    "mlp.c_fc.bias": ("mlp.dense_h_to_4h.bias", False),
    "mlp.c_proj.weight": ("mlp.dense_4h_to_h.weight", True),
    "mlp.c_proj.bias": ("mlp.dense_4h_to_h.bias", False),
}
_GLOBAL_MAP = {
    "wte.weight": "embedding.word_embeddings.weight",
    "wpe.weight": "embedding.position_embeddings.weight",
    "ln_f.weight": "transformer.final_layernorm.weight",
    "ln_f.bias": "transformer.final_layernorm.bias",
}


def qkv_to_per_head(tensor, heads):
    """``[q_all | k_all | v_all]`` rows -> per-head ``[heads, (q, k, v), head_dim]`` rows.

    Args:
        tensor: ``[3 * heads * head_dim, ...]`` weight rows (already ``[out, in]``) or bias.
        heads: attention heads.
    """
    rest = tensor.shape[1:]
    return tensor.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(tensor.shape)


def qkv_to_hf(tensor, heads):
    """Inverse of :func:`qkv_to_per_head`."""
    rest = tensor.shape[1:]
    return tensor.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(tensor.shape)


def args_from_hf_config(config):
    """Our saved-args dict (model part) from an HF GPT-2 ``config.json`` dict.

    Raises:
        ConfigError: a GPT-2 variant GPT2Model does not compute.
    """
    if config.get("model_type", "gpt2") != "gpt2":
        raise ConfigError(f"model_type {config.get('model_type')!r} is not GPT-2")
    act = config.get("activation_function", "gelu_new")
    problems = []
    if act not in TANH_GELU:
        problems.append(f"activation_function {act!r} (GPT2Model uses tanh GeLU: {TANH_GELU})")
    if not config.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=false")
    if config.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx=true")
    if config.get("add_cross_attention", False):
        problems.append("add_cross_attention=true")
    if config.get("tie_word_embeddings", True) is False:
        problems.append("tie_word_embeddings=false")
    hidden, heads = config["n_embd"], config["n_head"]
    if hidden % heads:
        problems.append(f"n_embd {hidden} not divisible by n_head {heads}")
    if problems:
        raise ConfigError("this HF GPT-2 cannot be converted: " + "; ".join(problems))
    return {
        "num_layers": config["n_layer"], "hidden_size": hidden, "num_attention_heads": heads,
        "kv_channels": hidden // heads, "ffn_hidden_size": config.get("n_inner") or 4 * hidden,
        "max_position_embeddings": config["n_positions"], "seq_length": config["n_positions"],
        "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5), "hidden_bias": True,
        "init_method_std": config.get("initializer_range", 0.02),
        "hidden_dropout": config.get("resid_pdrop", 0.1),
        "attention_dropout": config.get("attn_pdrop", 0.1),
        "true_vocab_size": config["vocab_size"], "padded_vocab_size": config["vocab_size"],
        "tokenizer_type": "GPT2BPETokenizer",
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "make_vocab_size_divisible_by": 1,
    }


def hf_config_from_args(args, true_vocab, eod_id):
    """An HF GPT-2 ``config.json`` dict for the model in our args.

    Args:
        args: saved args dict.
        true_vocab: real vocabulary rows (HF's ``vocab_size``).
        eod_id: end-of-document id (HF's ``bos_token_id`` / ``eos_token_id``).
    """
    hidden, heads = args["hidden_size"], args["num_attention_heads"]
    if args.get("kv_channels", hidden // heads) * heads != hidden:
        raise ConfigError(f"HF GPT-2 needs head size x heads = hidden; this model has "
                          f"{args['kv_channels']} x {heads} != {hidden}")
    if not args.get("hidden_bias", True):
        raise ConfigError("HF GPT-2 has biases in every linear layer; this model has none "
                          "(--no-hidden-bias)")
    ffn = args.get("ffn_hidden_size") or 4 * hidden
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": true_vocab, "n_positions": args["max_position_embeddings"],
        "n_embd": hidden, "n_layer": args["num_layers"], "n_head": heads,
        "n_inner": None if ffn == 4 * hidden else ffn, "activation_function": "gelu_new",
        "resid_pdrop": args.get("hidden_dropout", 0.1),
        "embd_pdrop": args.get("hidden_dropout", 0.1),
        "attn_pdrop": args.get("attention_dropout", 0.1),
        "layer_norm_epsilon": args.get("layernorm_epsilon", 1e-5),
        "initializer_range": args.get("init_method_std", 0.02),
        "scale_attn_weights": True, "use_cache": True, "tie_word_embeddings": True,
        "bos_token_id": eod_id, "eos_token_id": eod_id, "torch_dtype": "float32",
    }


def _strip_prefix(hf_state):
    """HF names without ``transformer.`` (GPT2LMHeadModel) and without mask buffers."""
    out = {}
    for key, tensor in hf_state.items():
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        out[key[len("transformer."):] if key.startswith("transformer.") else key] = tensor
    return out


def hf_to_full(hf_state, args):
    """HF GPT-2 tensors -> full GPT2Model state dict (real vocabulary rows, unpadded).

    Args:
        hf_state: ``GPT2LMHeadModel`` or ``GPT2Model`` state dict.
        args: from :func:`args_from_hf_config`.
    """
    state = _strip_prefix(hf_state)
    head = state.pop("lm_head.weight", None)
    if head is not None and not head.equal(state.get("wte.weight", head)):
        raise CheckpointError("lm_head.weight differs from transformer.wte.weight; only the "
                              "tied GPT-2 head is supported")
    heads, full = args["num_attention_heads"], {}
    for hf_key, key in _GLOBAL_MAP.items():
        full[key] = _take(state, hf_key)
    for i in range(args["num_layers"]):
        for hf_name, (name, transpose) in _LAYER_MAP.items():
            tensor = _take(state, f"h.{i}.{hf_name}")
            tensor = tensor.t() if transpose else tensor
            if hf_name.startswith("attn.c_attn"):
                tensor = qkv_to_per_head(tensor, heads)
            full[f"transformer.layers.{i}.{name}"] = tensor.contiguous()
    if state:
        raise CheckpointError(f"unexpected tensors in the HF checkpoint: {sorted(state)[:5]}")
    if full["embedding.word_embeddings.weight"].shape[0] != args["true_vocab_size"]:
        raise CheckpointError("wte.weight rows differ from the config's vocab_size")
    return full


def _take(state, key):
    if key not in state:
        raise CheckpointError(f"the HF checkpoint has no tensor {key!r} (incomplete, or not "
                              f"GPT-2 of the size its config says)")
    return state.pop(key)


def full_to_hf(full, args, true_vocab):
    """Full GPT2Model state dict -> ``GPT2LMHeadModel`` tensors (``lm_head`` left tied).

    Args:
        full: full state dict (padded vocabulary).
        args: saved args dict.
        true_vocab: real vocabulary rows to keep.
    """
    heads, out = args["num_attention_heads"], {}
    for hf_key, key in _GLOBAL_MAP.items():
        out[f"transformer.{hf_key}"] = full[key]
    out["transformer.wte.weight"] = full["embedding.word_embeddings.weight"][:true_vocab]
    for i in range(args["num_layers"]):
        for hf_name, (name, transpose) in _LAYER_MAP.items():
            tensor = full[f"transformer.layers.{i}.{name}"]
            if hf_name.startswith("attn.c_attn"):
                tensor = qkv_to_hf(tensor, heads)
            out[f"transformer.h.{i}.{hf_name}"] = tensor.t() if transpose else tensor
    return {k: v.contiguous() for k, v in out.items()}


# ---------------------------------------------------------------- the adapter
FAMILY = "gpt2"


def _tokenizer_files(request, hf_dir=None):
    """Absolute vocab/merge paths: flags first, then files next to the HF weights."""
    found = {}
    for key, name in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")):
        flag = getattr(request, key, None)
        if flag:
            if not os.path.isfile(flag):
                raise ConfigError(f"--{key.replace('_', '-')} {flag} does not exist")
            found[key] = os.path.abspath(flag)
        elif hf_dir and os.path.isfile(os.path.join(hf_dir, name)):
            found[key] = os.path.abspath(os.path.join(hf_dir, name))
    return found


def read_hf(path, request):
    """An HF GPT-2 directory as a :class:`FullCheckpoint` (real vocabulary rows only).

    Args:
        path: a ``save_pretrained`` directory.
        request: the conversion request (its ``iteration`` and tokenizer files go into the
            native output's args).
    """
    config = hf_io.read_config(path)
    args = args_from_hf_config(config)
    args.update(_tokenizer_files(request, path))
    args["eod_token_id"] = config.get("eos_token_id")
    state = hf_to_full(hf_io.read_weights(path), args)
    return FullCheckpoint(state, args, request.iteration or 0, {})


def write_hf(ckpt, path, request):
    """Write ``ckpt`` as an HF GPT-2 directory (config, safetensors, tokenizer files)."""
    args = {**ckpt.args, **_tokenizer_files(request)}
    true_vocab = resolve_true_vocab_size(args, request.true_vocab)
    if true_vocab is None:
        raise ConfigError("the real vocabulary size is unknown (the tokenizer files the "
                          "checkpoint names are gone); pass --true-vocab-size N or "
                          "--vocab-file/--merge-file")
    tokenizer = tokenizer_from_args(args)
    eod = tokenizer.eod if tokenizer is not None else args.get("eod_token_id")
    config = hf_config_from_args(args, true_vocab, eod)
    state = full_to_hf(ckpt.state, args, true_vocab)
    extra = []
    if args.get("tokenizer_type") == "GPT2BPETokenizer":
        extra = [(args[k], name) for k, name in (("vocab_file", "vocab.json"),
                                                 ("merge_file", "merges.txt"))
                 if args.get(k) and os.path.isfile(args[k])]
    hf_io.write_hf_dir(path, config, state, extra)
