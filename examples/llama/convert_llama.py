"""Export a checkpoint of the Llama example, saved at any (tp, pp, v), as a Hugging Face
``LlamaForCausalLM`` directory (``from_pretrained`` loads it).

    python examples/llama/convert_llama.py --load CHECKPOINT_DIR --output HF_DIR [--iteration N]

The checkpoint's tensors are merged by the sharding it records (no key map), then renamed
by :func:`llama_model.to_hf`. The directory is written as the project's converters write theirs
(:func:`megatron.checkpoint_conversion.hf_io.write_hf_dir`): into a temporary folder, every
file flushed to disk, then renamed into place and its parent flushed, so a killed export or a
crashed node never leaves a half directory under ``HF_DIR``.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # llama_model, megatron

from megatron.errors import run_main  # noqa: E402


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--iteration", type=int, default=None)
    args = p.parse_args(argv)
    export_hf(args.load, args.output, args.iteration)
    print(f"> wrote {args.output}")
    return 0


if __name__ == "__main__":
    run_main(main)
