"""Install megatron-tds: the packages ``megatron`` and ``tds``.

The fused kernels in ``csrc/`` are compiled on first use (see
``megatron/fused_kernels``). Set ``MEGATRON_TDS_BUILD_EXT=1`` to compile them
ahead of time here instead; a failed ahead-of-time build is reported and the
install continues, because every kernel has a PyTorch fallback.
"""
import os
import sys

from setuptools import find_packages, setup

# torch is a floor only: on a CPU machine install `torch==2.13.0` (the CPU
# wheel) first, and this range will not pull several GB of CUDA wheels.
INSTALL_REQUIRES = [
    "torch>=2.1",
    "deepspeed>=0.19,<0.20",
    "numpy",
    "sentencepiece",
    "regex",
    "pybind11",
    "pyyaml",
]

EXTRAS_REQUIRE = {
    "test": ["pytest", "transformers", "tokenizers", "tensorboard"],
    "tensorboard": ["tensorboard"],
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


ext_modules, cmdclass = _ext_modules()

setup(
    name="megatron-tds",
    version="0.1.0",
    description="Megatron-style 3D-parallel pretraining of GPT-2 and T5 on PyTorch and DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["megatron", "megatron.*", "tds", "tds.*"]),
    package_data={"megatron": ["../csrc/*", "../csrc/**/*"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
