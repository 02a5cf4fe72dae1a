"""What this machine's DeepSpeed accelerator runs, and stand-ins that emulate other devices.

Tests never depend on the host CPU's precision support without saying so:

- a test that needs real DeepSpeed fp16 (or bf16) execution carries :data:`requires_ds_fp16`
  (:data:`requires_ds_bf16`) and skips, with that reason, where the device lacks it;
- every other test that touches a precision passes an :class:`EmulatedAccelerator` (both
  sides), or runs through the refusal path with the capability switched off.

``MEGATRON_TDS_DS_FP16=0`` (``..._BF16=0``) makes the library report the capability as
missing on any machine (megatron.config.preflight.PRECISION_SWITCHES). The other side, a CPU
whose DeepSpeed accelerator has fp16, is emulated on one without by ``MEGATRON_TDS_TEST_CPU_FP16=1``
(:func:`emulate_cpu_fp16_if_asked`, tests only). ``.ci/run`` runs the suite on the CPU's own
kind, then the precision tests with the switch for the other kind, so a green CI means green on
a CPU with DeepSpeed fp16 and on one without.
"""
import os

import pytest

from megatron.config.preflight import deepspeed_precision_support

#: Tests only: "1" makes DeepSpeed's CPU accelerator report fp16 (see emulate_cpu_fp16_if_asked).
EMULATE_CPU_FP16 = "MEGATRON_TDS_TEST_CPU_FP16"


def emulate_cpu_fp16_if_asked():
    """With ``MEGATRON_TDS_TEST_CPU_FP16=1``: make DeepSpeed's CPU accelerator report fp16.

    DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels (AVX512-FP16
    or AMX-FP16 CPUs); torch's generic CPU kernels compute fp16 on any CPU. Reporting it
    runs DeepSpeed's fp16 paths (module.half(), the loss scaler, the fp16 and ZeRO-1 fp16
    optimizers) as on such a CPU, only with slower arithmetic. Called in the pytest process
    (this module's import) and in every rank of tests/harness.py. Only a CPU accelerator can
    be emulated: a GPU reports what it runs.

    Returns:
        True when the emulation is on.
    """
    value = os.environ.get(EMULATE_CPU_FP16, "")
    if value == "":
        return False
    if value != "1":
        raise ValueError(f"{EMULATE_CPU_FP16}={value!r}: only 1 (emulate a CPU with DeepSpeed "
                         f"fp16) is allowed; unset it to use what the device reports")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        raise ValueError(f"{EMULATE_CPU_FP16}=1 emulates fp16 on DeepSpeed's CPU accelerator; "
                         f"this run's is {accelerator.device_name()!r}: unset it")
    type(accelerator).is_fp16_supported = lambda self: True
    return True


emulate_cpu_fp16_if_asked()


class EmulatedAccelerator:
    """A stand-in for DeepSpeed's accelerator with chosen capabilities."""

    def __init__(self, fp16, bf16, name="cpu"):
        self._name, self._fp16, self._bf16 = name, fp16, bf16

    def device_name(self):
        return self._name

    def is_fp16_supported(self):
        return self._fp16

    def is_bf16_supported(self):
        return self._bf16


#: Both kinds of device a test of the validation emulates.
WITH_FP16 = EmulatedAccelerator(fp16=True, bf16=True)
WITHOUT_FP16 = EmulatedAccelerator(fp16=False, bf16=True)

_SUPPORT = deepspeed_precision_support()

requires_ds_fp16 = pytest.mark.skipif(
    not _SUPPORT["fp16"], reason="needs real fp16 execution in DeepSpeed, whose accelerator on "
    "this machine reports no fp16 (or MEGATRON_TDS_DS_FP16=0); the refusal is tested instead")
requires_ds_bf16 = pytest.mark.skipif(
    not _SUPPORT["bf16"], reason="needs real bf16 execution in DeepSpeed, whose accelerator on "
    "this machine reports no bf16 (or MEGATRON_TDS_DS_BF16=0); the refusal is tested instead")
