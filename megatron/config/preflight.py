"""Up-front checks of the run's directories, and of the device's precision support.

They run in the validation pass (the directories through
:func:`megatron.config.validation.rank_file_problems`), before torch.distributed exists, so
each rank checks for itself: a probe file per rank (named after its host and pid, so ranks
never collide) costs a few microseconds and needs no communication, and every rank reaches
the same verdict on a shared folder. Where the verdicts can differ (a mount lost on one
node), the ranks agree on them once torch.distributed starts
(:func:`megatron.initialize.initialize_megatron`). Each check appends a message to
``problems`` instead of raising, so a user sees every problem at once.
"""
import os
import socket
from typing import Any, Dict, List, Optional


def _nearest_existing(path):
    """``path`` or its closest existing ancestor (what ``os.makedirs`` would start from)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_save_dir(save: Optional[str], problems: List[str]) -> None:
    """``--save`` must be (or be creatable as) a directory this process can write.

    Found here rather than at the first save, after hours of training. The check creates
    nothing but a probe file it removes at once; a folder that does not exist yet is
    probed through its nearest existing ancestor, since the first save creates it.

    Args:
        save: the ``--save`` path or None.
        problems: list the message is appended to.
    """
    if not save:
        return
    base = _nearest_existing(save)
    if not os.path.isdir(base):
        problems.append(f"--save {save}: {base} is a file, not a directory")
        return
    probe = os.path.join(base, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        problems.append(f"--save {save} is not writable ({exc.strerror} in {base}); choose a "
                        f"folder you can write or fix its permissions")


def check_load_dir(args: Any, problems: List[str]) -> None:
    """``--load`` must exist, unless it is also ``--save`` (resume when there is something)
    or ``--load-if-exists`` says a missing folder means "start from scratch".

    A typo in ``--load`` would otherwise train from scratch and exit 0.

    Args:
        args: the parsed flags (``load``, ``save``, ``load_if_exists``).
        problems: list the message is appended to.
    """
    load = args.load
    if not load or os.path.isdir(load):
        return
    if os.path.exists(load):
        problems.append(f"--load {load} is a file; pass the checkpoint folder (the one holding "
                        f"latest_checkpointed_iteration.txt)")
        return
    same_as_save = args.save and os.path.abspath(args.save) == os.path.abspath(load)
    if same_as_save or args.load_if_exists:
        return
    problems.append(f"--load {load} does not exist; fix the path, or pass --load-if-exists "
                    f"(or the same folder as --save) to start from scratch when it is missing")


#: Environment switches that make DeepSpeed's accelerator report a precision as unsupported
#: ("0"), to check the refusal on a device that has it (the tests and .ci/run use them). They
#: can only take a capability away: DeepSpeed itself refuses a dtype its device lacks.
PRECISION_SWITCHES = {"fp16": "MEGATRON_TDS_DS_FP16", "bf16": "MEGATRON_TDS_DS_BF16"}


def deepspeed_precision_support(accelerator: Optional[Any] = None) -> Dict[str, bool]:
    """``{"fp16": bool, "bf16": bool}``: what DeepSpeed's accelerator runs.

    The switches (:data:`PRECISION_SWITCHES`) act on this machine's device only: a stand-in
    passed by a test describes another device, whose capabilities it states itself.

    Args:
        accelerator: DeepSpeed's accelerator object (default: ``get_accelerator()``, with the
            switches applied); tests pass a stand-in to emulate a device with or without a
            capability.
    """
    this_device = accelerator is None
    if this_device:
        accelerator = _this_accelerator()
    support = {"fp16": bool(accelerator.is_fp16_supported()),
               "bf16": bool(accelerator.is_bf16_supported())}
    if not this_device:
        return support
    for name, variable in PRECISION_SWITCHES.items():
        value = os.environ.get(variable)
        if value is None or value == "":
            continue
        if value != "0":
            raise ValueError(f"{variable}={value!r}: only 0 (report {name} as unsupported) is "
                             f"allowed; unset it to use what the device reports")
        support[name] = False
    return support


def check_precision(args: Any, problems: List[str], accelerator: Optional[Any] = None) -> None:
    """``--fp16`` / ``--bf16`` on a device that cannot run them, found before DeepSpeed starts.

    DeepSpeed (and so the tds engines) refuses a dtype its accelerator does not support,
    with a traceback from inside ``deepspeed.initialize`` on every rank. Only the DeepSpeed
    paths are checked: the DDP path computes through ``torch.autocast``, which runs fp16
    and bf16 on CPU and on any CUDA GPU.

    Args:
        args: the parsed flags (``fp16``, ``bf16``, ``deepspeed``, pipeline size).
        problems: list the message is appended to.
        accelerator: DeepSpeed's accelerator object (default: ``get_accelerator()``); tests
            pass a stand-in to emulate a device with or without the capability.
    """
    wanted = "fp16" if args.fp16 else "bf16" if args.bf16 else None
    if wanted is None or not uses_deepspeed(args):
        return
    support = deepspeed_precision_support(accelerator)
    if support[wanted]:
        return
    if accelerator is None:
        accelerator = _this_accelerator()
    device = describe_device(accelerator)
    other = "--bf16" if wanted == "fp16" and support["bf16"] else None
    fix = f"use {other} or fp32 (no precision flag)" if other else "use fp32 (no precision flag)"
    problems.append(f"--{wanted} is not supported by DeepSpeed on this device ({device}); {fix}, "
                    f"or run on a device with {wanted} support")


def _this_accelerator():
    """DeepSpeed's accelerator of this machine (through tds, which names the CPU one before
    DeepSpeed's detection would warn on every rank that it found no GPU)."""
    import tds  # noqa: F401

    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def uses_deepspeed(args: Any) -> bool:
    """True when the run trains through DeepSpeed's engine (``--deepspeed`` at pp 1; the
    backend factory's rule): every other run, pipelines included, is the project's step."""
    from .run_config import uses_pipeline_engine

    return bool(args.deepspeed) and not uses_pipeline_engine(args.pipeline_model_parallel_size)


def describe_device(accelerator: Any) -> str:
    """Words for the device DeepSpeed runs on, e.g. ``cpu accelerator: AMD EPYC 7B13``."""
    name = accelerator.device_name() if hasattr(accelerator, "device_name") else "?"
    model = ""
    if name.startswith("cpu"):
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
                model = next((line.split(":", 1)[1].strip() for line in handle
                              if line.startswith("model name")), "")
        except OSError:
            model = ""
    else:
        try:
            import torch

            model = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
        except Exception:  # a device without a name is still a device
            model = ""
    return f"{name} accelerator" + (f": {model}" if model else "")
