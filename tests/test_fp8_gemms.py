"""One FP8 GEMM against fp32, within the error the format predicts (megatron/mpu/fp8.py).

For ``C = A B`` with ``A`` and ``B`` cast to float8 (round to nearest), each element of a cast
operand is off by at most ``u |a| + d``: ``u`` half the format's relative spacing (e4m3: 2^-4,
e5m2: 2^-3) for normal numbers, ``d`` half the subnormal spacing divided by the scale that
was applied (absolute, for values that land below the smallest normal). So

    |C_fp8 - C| <= Ea |B| + |A| Eb + Ea Eb + (fp32 accumulation) + (bf16 rounding of C_fp8)

elementwise, with ``Ea = u_a |A| + d_a`` (``d`` per row of A / per column of B under rowwise;
the scales are powers of two rounded down: down to half the largest that fits). The inputs are
fresh random bf16 matrices whose rows (and columns) span four decades, so the subnormal
term is exercised and a rowwise bound (per-row ``d``) is far below what one tensorwise scale
would give. Each test also requires an error above what bf16 rounding alone gives (the GEMM
really is in FP8) and, with ``--fp8-format e4m3``, gradient GEMMs clearly more accurate than
the same GEMMs with an e5m2 gradient (``hybrid``'s).
"""
import pytest
import torch

from megatron import mpu
from megatron.mpu.fp8 import Fp8Gemms

N, IN, OUT = 96, 64, 48
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _cast_error(t, dtype, dim, rowwise):
    """Elementwise bound on |cast(t) - t| (fp32); ``dim`` the axis a rowwise scale spans."""
    fi = torch.finfo(dtype)
    amax = t.abs().amax(dim=dim, keepdim=True) if rowwise else t.abs().amax()
    smallest_scale = fi.max / amax / 2.0  # a power of two, rounded down
    subnormal = fi.smallest_normal * fi.eps / 2.0 / smallest_scale
    return fi.eps / 2.0 * t.abs() + subnormal


def _gemm_bound(a, b, a_dtype, b_dtype, rowwise):
    """Elementwise bound on |fp8(a) @ fp8(b) - a @ b| (``a [M, K]``, ``b [K, N]``)."""
    ea, eb = _cast_error(a, a_dtype, 1, rowwise), _cast_error(b, b_dtype, 0, rowwise)
    cast = ea @ b.abs() + a.abs() @ eb + ea @ eb
    k = a.size(1)
    accumulate = k * 2.0 ** -24 * ((a.abs() + ea) @ (b.abs() + eb))
    exact = a @ b
    rounding = 2.0 ** -8 * (exact.abs() + cast + accumulate)  # the bf16 result
    return (cast + accumulate + rounding) * (1 + 1e-4), rounding + accumulate


def _spread(shape, generator, dim):
    """bf16 values whose slices along ``dim`` span 1e-4 .. 1 in magnitude."""
    t = torch.randn(shape, generator=generator)
    size = [1, 1]
    size[dim] = shape[dim]
    decades = torch.linspace(-4, 0, shape[dim]).reshape(size)
    return (t * 10.0 ** decades).to(torch.bfloat16)


@pytest.mark.parametrize("recipe", mpu.FP8_RECIPES)
@pytest.mark.parametrize("fmt", mpu.FP8_FORMATS)
def test_fp8_gemms_are_within_the_format_bound(recipe, fmt, seed):
    g = torch.Generator().manual_seed(seed)
    gemms = Fp8Gemms(mpu.Fp8Recipe(fmt, recipe))
    rowwise = recipe == "rowwise"
    x = _spread((N, IN), g, 0)  # rows (tokens) of different sizes
    w = _spread((OUT, IN), g, 0)
    dy = _spread((N, OUT), g, 1)
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    y, (x_amax, w_amax) = gemms.linear(x, w)
    dx, dy_amax = gemms.input_grad(dy, w, w_amax)
    dw = gemms.weight_grad(dy, x, dy_amax, x_amax)
    xf, wf, dyf = x.float(), w.float(), dy.float()
    cases = {"forward X W^T": (y, xf, wf.t(), E4M3, E4M3),
             "input grad dY W": (dx, dyf, wf, grad_dtype, E4M3),
             "weight grad dY^T X": (dw, dyf.t(), xf, grad_dtype, E4M3)}
    for name, (got, a, b, a_dtype, b_dtype) in cases.items():
        assert got.dtype == torch.bfloat16, name
        error = (got.float() - a @ b).abs()
        bound, bf16_only = _gemm_bound(a, b, a_dtype, b_dtype, rowwise)
        worst = (error / bound).max().item()
        assert worst <= 1.0, f"{name}: error {worst:.2f} x the {fmt} {recipe} bound"
        assert (error > 4 * bf16_only).any(), f"{name}: no FP8 error at all"
    if fmt == "e4m3":  # the gradient really is e4m3: an e5m2 one doubles its rounding
        wider = Fp8Gemms(mpu.Fp8Recipe("hybrid", recipe))
        e5_dx = wider.input_grad(dy, w, w_amax)[0]
        e5_dw = wider.weight_grad(dy, x, dy_amax, x_amax)
        for name, ours, e5, exact in (("input grad", dx, e5_dx, dyf @ wf),
                                      ("weight grad", dw, e5_dw, dyf.t() @ xf)):
            ours_rms, e5_rms = ((t.float() - exact).norm().item() for t in (ours, e5))
            assert ours_rms < 0.8 * e5_rms, (name, ours_rms, e5_rms)


def test_rowwise_scales_each_row_tensorwise_does_not(seed):
    """Rows six decades apart: rowwise scaling keeps every row's relative error at FP8's
    few percent; one tensorwise scale sends the smallest rows' values under the smallest
    subnormal (to zero)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, IN, generator=g) *
         10.0 ** torch.linspace(-6, 0, N).reshape(-1, 1)).to(torch.bfloat16)
    w = torch.randn(OUT, IN, generator=g).to(torch.bfloat16)
    exact = x.float() @ w.float().t()
    small = slice(0, N // 10)  # the smallest rows
    errors = {}
    for recipe in mpu.FP8_RECIPES:
        y, _ = Fp8Gemms(mpu.Fp8Recipe("e4m3", recipe)).linear(x, w)
        errors[recipe] = ((y.float() - exact)[small].norm(dim=1) /
                          exact[small].norm(dim=1)).max().item()
    assert errors["rowwise"] < 0.1 and errors["tensorwise"] > 0.5, errors


def test_scaled_mm_layouts_and_out_dtypes(seed):
    """The wrapper makes A row-major and B column-major (what CUDA takes) whatever the views
    it gets, and gives the requested dtype (rowwise: through bf16)."""
    from megatron.mpu.fp8 import scaled_mm

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(32, 64, generator=g).to(E4M3)
    b = torch.randn(64, 48, generator=g).to(E4M3)
    ref = a.float() @ b.float()
    one = torch.tensor(1.0)
    rows, cols = torch.ones(32, 1), torch.ones(1, 48)
    for a_view, b_view in ((a, b), (a.t().contiguous().t(), b.t().contiguous().t())):
        for a_inv, b_inv in ((one, one), (rows, cols)):
            for dtype in (torch.bfloat16, torch.float32):
                out = scaled_mm(a_view, a_inv, b_view, b_inv, dtype)
                assert out.dtype == dtype
                torch.testing.assert_close(out.float(), ref, rtol=2 ** -8, atol=1e-3)


def test_recipe_rejects_unknown_names():
    from megatron.common.errors import ConfigError

    with pytest.raises(ConfigError, match="FP8 format 'e5m2'"):
        mpu.Fp8Recipe("e5m2")
    with pytest.raises(ConfigError, match="FP8 recipe 'delayed'"):
        mpu.Fp8Recipe("e4m3", "delayed")
    assert "gradients e5m2" in mpu.Fp8Recipe("hybrid", "rowwise").describe()
