"""The run's settings, checked once, in one process, before any launcher starts:

    python -m megatron.launch.check --script examples/run_gpt2.sh --world-size 8 \\
        pretrain_gpt2.py --num-layers 24 ...

examples/launch_common.sh runs it on each node before torchrun (or the DeepSpeed launcher).
It runs the entry script's ``main()`` in the settings-check mode of
:func:`megatron.training.pretrain` (``MEGATRON_TDS_CHECK_ONLY=1``): the flags, the YAML file,
every check, the tokenizer and the files this node sees, for the full world size, with no
process group. A problem is printed once, each line followed by the run script's variables
that set the flags it names, and the status is 2: the launcher never starts, so no elastic
agent restarts a run that cannot work (torchrun's ``--max-restarts`` would print the same
error block once per rank per attempt).
"""
import argparse
import gc
import os
import re
import runpy
import sys

from ..config import CHECK_ONLY_ENV
from ..common.errors import USER_ERROR_EXIT, MegatronError

#: What in a message names a setting (a regular expression) -> the run script's variable
#: that sets it (examples/run_gpt2.sh, run_t5.sh; tests/test_launch_check.py checks that
#: each script passes the flag from the variable).
SCRIPT_VARIABLES = (
    (r"--model-parallel-size|tensor-model-parallel size", "mp_size"),
    (r"--pipe-parallel-size|pipeline-model-parallel size", "pp_size"),
    (r"--context-parallel-size|context-parallel size", "cp_size"),
    (r"--expert-model-parallel-size|expert-model-parallel size", "ep_size"),
    (r"--num-experts", "NUM_EXPERTS"),
    (r"--virtual-pipeline-model-parallel-size", "vpp_size"),
    (r"--pipeline-schedule", "PIPELINE_SCHEDULE"),
    (r"--num-layers", "NLAYERS"),
    (r"--hidden-size", "NHIDDEN"),
    (r"--num-attention-heads", "NHEADS"),
    (r"--kv-hidden-size", "KV_HIDDEN"),
    (r"--ff-hidden-size", "FF_HIDDEN"),
    (r"--seq-length|--max-position-embeddings", "SEQLEN"),
    (r"--enc-seq-length", "ENC_SEQLEN"),
    (r"--dec-seq-length", "DEC_SEQLEN"),
    (r"--batch-size", "BATCHSIZE"),
    (r"--global-batch-size|--gas", "GAS"),
    (r"--train-iters", "TRAIN_ITERS"),
    (r"--lr", "LR"),
    (r"--hidden-dropout", "HIDDEN_DROPOUT"),
    (r"--attention-dropout", "ATTENTION_DROPOUT"),
    (r"--fp16|--bf16", "PRECISION"),
    (r"--fp8-format", "FP8"),
    (r"--fp8-recipe", "FP8_RECIPE"),
    (r"--data-path|data prefix", "DATA_PATH"),
    (r"--vocab-file", "VOCAB_FILE"),
    (r"--merge-file", "MERGE_FILE"),
    (r"--tokenizer-model", "TOKENIZER_MODEL"),
    (r"--save|--load", "CHECKPOINT_PATH"),
    (r"--deepspeed_config", "config_json"),
    (r"--step-timeout", "STEP_TIMEOUT"),
    (r"--async-save", "ASYNC_SAVE"),
    (r"--checkpoint-activations", "RECOMPUTE"),
    (r"--attention-backend", "ATTENTION_BACKEND"),
    (r"--compile", "COMPILE"),
    (r"--tensorboard-dir", "TENSORBOARD_DIR"),
    (r"world size", "GPUS_PER_NODE x NNODES"),
)
_PATTERNS = [(re.compile(rf"(?<![\w-])(?:{words})(?![\w-])"), name)
             for words, name in SCRIPT_VARIABLES]


def script_variables(line):
    """The run script's variables behind the settings ``line`` names, in table order."""
    return [name for pattern, name in _PATTERNS if pattern.search(line)]


def defined_variables(script):
    """The variables ``script`` (a run script's path) assigns; None when it cannot be read
    (then every variable of :data:`SCRIPT_VARIABLES` may be named)."""
    try:
        with open(script, encoding="utf-8") as handle:
            return set(re.findall(r"^\s*([A-Za-z_]\w*)=", handle.read(), re.MULTILINE))
    except OSError:
        return None


def annotate(message, script):
    """``message`` with each line that names a setting followed by the variables of the run
    script ``script`` (a path) that set it."""
    defined = defined_variables(script)
    out = []
    for line in message.splitlines():
        names = [name for name in script_variables(line) if defined is None or
                 all(part in defined for part in name.split(" x "))]
        label = os.path.basename(script)
        out.append(f"{line}  [{label}: {', '.join(names)}]" if names else line)
    return "\n".join(out)


def _entry_main(entry):
    """The entry script's ``main`` (loaded without running its ``__main__`` block), or None
    for a script without one (then it is run as ``__main__``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(entry)))
    with open(entry, encoding="utf-8") as handle:
        if not re.search(r"^def main\(", handle.read(), re.MULTILINE):
            return None
    return runpy.run_path(entry, run_name="__megatron_settings_check__")["main"]


def check(entry, flags, world_size, script):
    """Run ``entry``'s settings check; return the exit status (0: fine, 2: a problem,
    printed once)."""
    os.environ.update({CHECK_ONLY_ENV: "1", "WORLD_SIZE": str(world_size), "RANK": "0",
                       "LOCAL_RANK": "0"})
    sys.argv = [entry, *flags]
    try:
        main = _entry_main(entry)
        if main is None:
            runpy.run_path(entry, run_name="__main__")
        else:
            main()
    except (MegatronError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
        print(f"error: {annotate(str(exc), script)}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    except SystemExit as exc:  # argparse's own message (printed), or the script's run_main
        return exc.code if isinstance(exc.code, int) else USER_ERROR_EXIT
    print(f"> settings checked for a world of {world_size} processes", flush=True)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", default="the run script",
                        help="the run script, named next to the variables in a message")
    parser.add_argument("--world-size", type=int, required=True,
                        help="processes of the whole run (GPUS_PER_NODE x NNODES)")
    parser.add_argument("entry", help="the entry script (pretrain_gpt2.py, ...)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="its flags")
    opts = parser.parse_args(argv)
    return check(opts.entry, opts.flags, opts.world_size, opts.script)


if __name__ == "__main__":
    status = main()
    gc.freeze()  # the interpreter's final collections would only delay the launch
    sys.exit(status)
