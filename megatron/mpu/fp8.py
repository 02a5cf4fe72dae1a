"""FP8 GEMMs of the mpu linear layers: dynamic scaling, tensorwise or rowwise.

A linear layer ``Y = X W^T`` runs three GEMMs; each operand is scaled to the float8 range
from its current absolute maximum (amax: "dynamic" or "current" scaling, no history to keep),
cast, and multiplied by ``torch._scaled_mm``, which takes the inverse scales and returns
the compute dtype (bf16):

    forward         Y  = X  @ W^T     K = in     X, W in e4m3
    input grad      dX = dY @ W       K = out    dY in e4m3 (``e4m3``) or e5m2 (``hybrid``)
    weight grad     dW = dY^T @ X     K = n      (n: the tokens of the micro-batch)

``tensorwise``: one scale per operand. ``rowwise``: one scale per row of the left operand and
per column of the right one, i.e. the amax is taken along the GEMM's K axis only. Both round
the scales down to a power of two (torchao's rowwise default, here for tensorwise too): the
cast then multiplies exactly, and an amax that moves by rounding noise (bf16 partial sums at
another tp size) rarely changes the scale, where a free scale would re-round the whole
tensor. The scale and cast
utilities are torchao's (``torchao.float8``: ``amax_to_scale``, ``to_fp8_saturated``); the
GEMMs, and the autograd functions around them, stay the mpu layers' own, because those also
own the tensor-parallel collectives, the sequence-parallel all-gathers and the zero-bubble
deferral of the weight GEMM (torchao's ``Float8Linear`` is an ``nn.Linear`` swap that owns
its autograd function, so it cannot sit inside them; docs/mpu.md, "FP8").

**The scales of a tensor-parallel shard.** A column-parallel layer splits ``out`` across the
tp ranks, a row-parallel one ``in``. Where an operand's amax is taken over a split axis, each
rank's local amax is the amax of its shard only; it is all-reduced (MAX) over the
tensor-parallel group, so every rank scales by the amax of the whole logical tensor: its
shard is cast exactly as tp = 1 casts that part (torchtitan #3109 trained with local amaxes
and went NaN). Which operands that is, by recipe (``sharded`` axis = out | in):

    tensorwise: W always; X at row-parallel (``in``); dY at column-parallel (``out``)
    rowwise:    forward at row-parallel (K = in: X's rows, W's rows);
                input grad at column-parallel (K = out: dY's rows, W's columns);
                weight grad never (K = n is not split by tensor parallelism)

A tensorwise amax is computed once per tensor and reused by the other GEMM that reads the
same tensor (X's and W's from the forward, dY's from the input grad), so the weight grad of
a zero-bubble W pass needs no collective of its own.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..common.errors import ConfigError

#: ``--fp8-format``: the forward operands are e4m3; ``hybrid`` casts the gradient e5m2.
FORMATS = ("e4m3", "hybrid")
#: ``--fp8-recipe``: how the operands are scaled.
RECIPES = ("tensorwise", "rowwise")
#: ``torch._scaled_mm`` on CUDA needs the GEMMs' K and N to be multiples of this.
GEMM_MULTIPLE = 16
#: Where FP8 GEMMs run on a GPU: compute capability 8.9 (Ada) and 9.0 (Hopper) and later.
MIN_CUDA_CAPABILITY = (8, 9)

_TORCHAO = {}


def _torchao():
    """torchao's float8 scale and cast utilities, imported on first use (they load torchao,
    seconds of imports a run without FP8 does not need)."""
    if not _TORCHAO:
        import logging

        # torchao's import reports its CUDA-only extensions failing to load on a machine
        # without them and a torch deprecation notice: neither concerns the two functions
        # used here
        quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
        levels = [log.level for log in quiet]
        for log in quiet:
            log.setLevel(logging.ERROR)
        try:
            from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated
        except ImportError as exc:
            raise ConfigError("FP8 training needs torchao (its float8 scaling): "
                              "pip install -e '.[fp8]' (or pip install torchao)") from exc
        finally:
            for log, level in zip(quiet, levels):
                log.setLevel(level)
        _TORCHAO.update(amax_to_scale=amax_to_scale, to_fp8_saturated=to_fp8_saturated)
    return _TORCHAO


def torchao_available() -> bool:
    """Whether torchao's float8 utilities import here."""
    try:
        _torchao()
    except ConfigError:
        return False
    return True


@dataclass(frozen=True)
class Fp8Recipe:
    """What ``--fp8-format`` and ``--fp8-recipe`` ask for (Megatron-LM's names).

    Args:
        format: ``e4m3`` (every operand e4m3) or ``hybrid`` (the gradient dY e5m2).
        recipe: ``tensorwise`` or ``rowwise`` scaling (the module docstring).
    """

    format: str = "e4m3"
    recipe: str = "tensorwise"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ConfigError(f"FP8 format {self.format!r}: use one of {', '.join(FORMATS)}")
        if self.recipe not in RECIPES:
            raise ConfigError(f"FP8 recipe {self.recipe!r}: use one of {', '.join(RECIPES)}")

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    @property
    def grad_dtype(self) -> torch.dtype:
        """dtype of the output gradient dY in the two backward GEMMs."""
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn

    def describe(self) -> str:
        """Words for the start-up line, e.g. ``FP8 hybrid (e4m3, gradients e5m2), rowwise``."""
        what = "e4m3, gradients e5m2" if self.format == "hybrid" else "e4m3 throughout"
        return f"FP8 {self.format} ({what}), {self.recipe} scaling"


#: operand -> its axes (2-D, as the GEMMs see it)
_AXES = {"x": ("n", "in"), "w": ("out", "in"), "dy": ("n", "out")}


@dataclass(frozen=True)
class Fp8Gemms:
    """The three FP8 GEMMs of one linear layer (what its autograd functions call).

    Args:
        recipe: the :class:`Fp8Recipe`.
        sharded: the weight axis split across the tensor-parallel ranks: ``"out"``
            (column-parallel), ``"in"`` (row-parallel) or None (tp = 1).
        group: the tensor-parallel group the amaxes of split axes are all-reduced over
            (None: nothing to reduce).
    """

    recipe: Fp8Recipe
    sharded: Optional[str] = None
    group: Optional[object] = None

    @property
    def spec(self) -> str:
        """``"format,recipe,sharded"``: what a custom operator takes (with the group from
        its slot, :meth:`from_spec`)."""
        return f"{self.recipe.format},{self.recipe.recipe},{self.sharded or ''}"

    @staticmethod
    def from_spec(spec: str, group) -> "Fp8Gemms":
        """The :class:`Fp8Gemms` of a :attr:`spec` and the layer's tensor-parallel group."""
        fmt, recipe, sharded = spec.split(",")
        return Fp8Gemms(Fp8Recipe(fmt, recipe), sharded or None, group if sharded else None)

    def _amax(self, t, operand, k_axis):
        """The amax that scales ``t``: whole tensor (tensorwise) or along ``k_axis``
        (rowwise, keepdim), all-reduced where it spans the split axis."""
        axes = _AXES[operand]
        if self.recipe.rowwise:
            amax = t.abs().amax(dim=axes.index(k_axis), keepdim=True)
            spans_split = k_axis == self.sharded
        else:
            amax = t.abs().amax()
            spans_split = self.sharded in axes
        amax = amax.float()
        if spans_split and self.group is not None:
            amax = _all_reduce_max(amax, self.group)
        return amax

    def _cast(self, t, operand, k_axis, dtype, amax=None):
        """``(t in float8, inverse scale, amax)``; a tensorwise ``amax`` given is reused."""
        if amax is None or self.recipe.rowwise:
            amax = self._amax(t, operand, k_axis)
        lib = _torchao()
        scale = lib["amax_to_scale"](amax, dtype,
                                     round_scales_to_power_of_2=True)
        data = lib["to_fp8_saturated"](t.to(torch.float32) * scale, dtype)
        return data, scale.reciprocal(), amax

    def _keep(self, amax):
        return None if self.recipe.rowwise else amax

    def linear(self, x, weight, bias=None) -> Tuple[torch.Tensor, tuple]:
        """``x @ weight^T (+ bias)`` in FP8.

        Args:
            x: ``[n, in]``; weight: ``[out, in]``; bias: ``[out]`` or None.

        Returns:
            ``([n, out]`` in ``x``'s dtype, ``(x_amax, w_amax))``: the tensorwise amaxes for
            the backward (None each under rowwise, whose backward scales along other axes).
        """
        e4m3 = torch.float8_e4m3fn
        xq, x_inv, x_amax = self._cast(x, "x", "in", e4m3)
        wq, w_inv, w_amax = self._cast(weight, "w", "in", e4m3)  # rowwise: [out, 1]
        out = scaled_mm(xq, x_inv, wq.t(), _transposed(w_inv), x.dtype, fast_accum=True)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out, (self._keep(x_amax), self._keep(w_amax))

    def input_grad(self, grad, weight, w_amax=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``dX = dY @ W`` in FP8: ``([n, in], dy_amax)`` (tensorwise dY's amax, for
        :meth:`weight_grad`; None under rowwise).

        Args:
            grad: dY ``[n, out]``; weight: ``[out, in]``; w_amax: the forward's (tensorwise).
        """
        gq, g_inv, g_amax = self._cast(grad, "dy", "out", self.recipe.grad_dtype)
        wq, w_inv, _ = self._cast(weight, "w", "out", torch.float8_e4m3fn, w_amax)
        return scaled_mm(gq, g_inv, wq, w_inv, grad.dtype), self._keep(g_amax)

    def weight_grad(self, grad, x, dy_amax=None, x_amax=None) -> torch.Tensor:
        """``dW = dY^T @ X`` in FP8: ``[out, in]`` in ``grad``'s dtype.

        Args:
            grad: dY ``[n, out]``; x: ``[n, in]``; dy_amax, x_amax: tensorwise amaxes
                already agreed on (from :meth:`input_grad` and :meth:`linear`).
        """
        gq, g_inv, _ = self._cast(grad, "dy", "n", self.recipe.grad_dtype, dy_amax)
        xq, x_inv, _ = self._cast(x, "x", "n", torch.float8_e4m3fn, x_amax)
        return scaled_mm(gq.t(), _transposed(g_inv), xq, x_inv, grad.dtype)  # [out, in]


def _transposed(inv):
    """A rowwise scale of the transposed operand (``[m, 1] <-> [1, m]``), laid out as
    ``_scaled_mm`` checks it; a tensorwise one as it is."""
    return inv if inv.dim() == 0 else inv.reshape(inv.shape[::-1])


def _all_reduce_max(amax, group):
    """MAX over ``group`` (a functional collective in compiled code)."""
    if torch.compiler.is_compiling():
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(amax, "max", group)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def scaled_mm(a, a_inv, b, b_inv, out_dtype, fast_accum=False) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` through ``torch._scaled_mm``, in ``out_dtype``.

    ``a`` is made row-major and ``b`` column-major (what cuBLAS and CUTLASS take; a copy of
    a float8 tensor where the layout differs). Rowwise scales (``a_inv [M, 1]``, ``b_inv
    [1, N]``) give a bf16 result on CUDA, cast to ``out_dtype`` after.

    Args:
        a: ``[M, K]`` float8; b: ``[K, N]`` float8 (e5m2 only on the left).
        a_inv, b_inv: inverse scales, 0-dim or rowwise.
        out_dtype: the result's dtype.
        fast_accum: the forward GEMM's faster accumulation on Hopper (torchao's default).
    """
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(0) != 1:
        b = b.t().contiguous().t()
    rowwise = a_inv.dim() > 0
    dtype = torch.bfloat16 if rowwise else out_dtype
    out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv,
                           out_dtype=dtype, use_fast_accum=fast_accum)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def layer_gemms(recipe: Optional[Fp8Recipe], sharded: str, group, tp_size: int,
                sizes: Tuple[int, int], layer: str) -> Optional[Fp8Gemms]:
    """The :class:`Fp8Gemms` of a parallel linear layer (None without a recipe), refusing
    GEMM dimensions cuBLAS's FP8 GEMM cannot take.

    Args:
        recipe: the layer's ``fp8`` argument.
        sharded: ``"out"`` (column-parallel) or ``"in"`` (row-parallel).
        group, tp_size: the layer's tensor-parallel group and its size.
        sizes: the local ``(in, out)`` of this rank's GEMM.
        layer: the layer's name for the message.
    """
    if recipe is None:
        return None
    if not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"{layer}: fp8 must be an mpu.Fp8Recipe or None, got "
                        f"{type(recipe).__name__}")
    bad = [f"{name} {size}" for name, size in zip(("input", "output"), sizes)
           if size % GEMM_MULTIPLE]
    if bad:
        raise ConfigError(f"{layer} in FP8: this rank's GEMM has {', '.join(bad)}, not "
                          f"a multiple of {GEMM_MULTIPLE} (what torch._scaled_mm needs on "
                          f"a GPU); change the layer's sizes or the tensor-parallel size, or "
                          f"build it without fp8")
    _torchao()  # a missing torchao is said at model build time, not in the first step
    return Fp8Gemms(recipe, sharded if tp_size > 1 else None,
                    group if tp_size > 1 else None)
