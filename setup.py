"""Install megatron-tds: the packages ``megatron`` and ``tds``.

The fused kernels in ``csrc/`` are compiled on first use (see
``megatron/fused_kernels``). Set ``MEGATRON_TDS_BUILD_EXT=1`` to compile them
ahead of time here instead; a failed ahead-of-time build is reported and the
install continues, because every kernel has a PyTorch fallback.
"""
import os
import shutil
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))

# torch is a floor only: on a CPU machine install `torch==2.13.0` (the CPU
# wheel) first, and this range will not pull several GB of CUDA wheels. 2.4 is the
# oldest with torch.library.custom_op (the fused kernels' operators) and sdpa_kernel.
INSTALL_REQUIRES = [
    "torch>=2.4",
    # tds uses DeepSpeed's public API only: the oldest release .ci/run tests (tds.OLDEST_DEEPSPEED)
    # and every later one
    "deepspeed>=0.17",
    "numpy",
    "sentencepiece",
    "regex",
    "pybind11",
    "pyyaml",
    "safetensors",
    "tqdm",
    "xxhash",  # checkpoint digests (megatron/checkpoint/digest.py)
]

EXTRAS_REQUIRE = {
    # pytest-xdist: the suite runs on every core by default (tests/parallel_suite.py)
    "test": ["pytest", "pytest-xdist", "transformers", "tokenizers", "tensorboard", "wandb",
             "matplotlib", "torchao>=0.12"],
    "fp8": ["torchao>=0.12"],  # --fp8-format: torchao's float8 scaling (megatron/mpu/fp8.py)
    "tensorboard": ["tensorboard"],
    "wandb": ["wandb"],  # --wandb-project
    "plot": ["matplotlib"],  # tools/plot_runs.py, benchmarks/kernels.py --plot
}


def _ext_modules():
    """Ahead-of-time kernel build, only when asked for."""
    if os.environ.get("MEGATRON_TDS_BUILD_EXT", "0") != "1":
        return [], {}
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from megatron.fused_kernels.build import aot_extensions

        return aot_extensions()
    except Exception as exc:  # never fail the install: kernels have fallbacks
        print(f"megatron-tds: ahead-of-time kernel build skipped ({exc})")
        return [], {}


class BuildPyWithSources(build_py):
    """Copy the top-level ``csrc/`` into the built package as ``megatron/csrc``.

    The repository keeps the kernel sources at the top (DESIGN.md's layout); a wheel or
    ``pip install .`` must carry them inside the package so that the just-in-time build
    finds them (megatron.fused_kernels.build_utils.find_csrc_dir looks there first). An editable install
    compiles from the checkout's ``csrc/`` and needs no copy.
    """

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = os.path.join(self.build_lib, "megatron", "csrc")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(os.path.join(HERE, "csrc"), target,
                        ignore=shutil.ignore_patterns("__pycache__", "*.o", "*.so"))


ext_modules, cmdclass = _ext_modules()
cmdclass = dict(cmdclass, build_py=BuildPyWithSources)

setup(
    name="megatron-tds",
    version="0.1.0",
    description="Megatron-style 3D-parallel pretraining of GPT-2 and T5 on PyTorch and DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*", "tds", "tds.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
