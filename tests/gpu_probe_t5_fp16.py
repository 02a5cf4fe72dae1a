"""Which part of T5's fp16 step on CUDA stops it training (issue 38, found on the H100).

On the H100, tests/test_gpu_training.py's T5 fp16 runs (torch DDP and DeepSpeed ZeRO-1)
followed the fp32 CPU run for two steps, then skipped every update (an overflow at every
loss scale, down to DeepSpeed's minimum), while GPT-2 fp16 and T5 bf16 trained. This runs the
same 30 steps once per variant, each switching one suspect off, in parallel processes:

    PYTHONPATH=. python tests/gpu_probe_t5_fp16.py    # PROBE_DEVICE=cpu: the same on the CPU

and prints, per variant, the losses' first / last values and whether it trained.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: variant -> (extra flags, environment, SDPA backends to leave on or None for PyTorch's pick)
VARIANTS = {
    "fp16 (as the test)": ((), {}, None),
    "fp16, no fused kernels": ((), {"MEGATRON_TDS_NO_FUSED_KERNELS": "1"}, None),
    "fp16, unfused attention": (("--attention-backend", "unfused"), {}, None),
    "fp16, SDPA without cuDNN": ((), {}, ("flash", "mem_efficient", "math")),
    "fp16, SDPA math only": ((), {}, ("math",)),
    "bf16 (control)": (("--bf16",), {}, None),
}


def train_with_sdpa(argv, backends):
    """Rank body: train T5 with only ``backends`` of SDPA enabled (None: all)."""
    import torch

    from t5_runs import train_t5

    if backends is not None:
        for name in ("flash", "mem_efficient", "math", "cudnn"):
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(name in backends)
    return train_t5(argv)


def run_variant(name, data):
    from harness import run_distributed
    from test_gpu_training import t5_flags

    flags, env, backends = VARIANTS[name]
    precision = () if "--bf16" in flags else ("--fp16",)
    argv = t5_flags(data, *precision, *flags)
    losses = run_distributed(train_with_sdpa, 1, argv, backends,
                             env={"MEGATRON_DEVICE": os.environ.get("PROBE_DEVICE", "cuda"), **env},
                             timeout=400)[0][0]
    return losses


def main():
    if len(sys.argv) == 3:  # one variant, in its own process
        name, data = sys.argv[1], json.loads(sys.argv[2])
        try:
            losses = run_variant(name, data)
            print("RESULT", json.dumps({"name": name, "losses": losses}), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, the other variants go on
            print("RESULT", json.dumps({"name": name, "error": str(exc)[-1500:]}), flush=True)
        return
    import conftest

    class Factory:
        def __init__(self, root):
            self.root = root

        def mktemp(self, name):
            return Path(tempfile.mkdtemp(prefix=name, dir=self.root))

    root = tempfile.mkdtemp()
    data = conftest._t5_data(Factory(root))
    procs = {name: subprocess.Popen([sys.executable, __file__, name, json.dumps(data)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for name in VARIANTS}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: no result (exit {proc.returncode})")
            continue
        result = json.loads(line[len("RESULT "):])
        if "error" in result:
            error = result["error"]
            start = error.find("raised -----")
            print(f"{name}: FAILED {error[start:start + 900] if start >= 0 else error[-900:]}")
            continue
        losses = result["losses"]
        trained = losses[-1] < losses[0] - 0.5
        print(f"{name}: {'trains' if trained else 'STUCK'}; loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}; steps 1-5 {[round(v, 4) for v in losses[:5]]}")


if __name__ == "__main__":
    main()
