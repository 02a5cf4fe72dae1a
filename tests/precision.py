"""What this machine's DeepSpeed accelerator runs, and stand-ins that emulate other devices.

Tests never depend on the host CPU's precision support without saying so:

- a test that needs real DeepSpeed fp16 (or bf16) execution carries :data:`requires_ds_fp16`
  (:data:`requires_ds_bf16`) and skips, with that reason, where the device lacks it;
- every other test that touches a precision passes an :class:`EmulatedAccelerator` (both
  sides), or runs through the refusal path with the capability switched off.

``MEGATRON_TDS_DS_FP16=0`` (``..._BF16=0``) makes the library report the capability as
missing on any machine (megatron.config.preflight.PRECISION_SWITCHES); ``.ci/run`` runs the
precision tests once that way, so a green CI means green on a CPU without DeepSpeed fp16.
"""
import pytest

from megatron.config.preflight import deepspeed_precision_support


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
