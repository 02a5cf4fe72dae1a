"""GPT-2 trains the same with the fused kernels on and off (fp32, CPU: 1e-5 relative)."""
from gpt2_runs import gpt2_argv
from harness import run_distributed


def _train_and_report_paths(argv):
    import pretrain_gpt2
    from megatron import fused_kernels

    state = pretrain_gpt2.main(argv)
    return state.losses, str(fused_kernels.status())


def test_fused_kernels_give_the_unfused_losses(gpt2_data):
    argv = gpt2_argv(gpt2_data, "--batch-size", "4", "--gas", "2", "--train-iters", "8",
                     "--hidden-dropout", "0", "--attention-dropout", "0")
    (fused, fused_status), = run_distributed(_train_and_report_paths, 1, argv)
    (plain, plain_status), = run_distributed(
        _train_and_report_paths, 1, argv + ["--no-masked-softmax-fusion", "--no-layernorm-fusion"])
    assert "masked softmax: fused CPU kernel" in fused_status, fused_status
    assert "layer norm: fused CPU kernel" in fused_status, fused_status
    assert "fused" not in plain_status.replace("fusion", ""), plain_status
    assert max(abs(a - b) / abs(b) for a, b in zip(fused, plain)) < 1e-5, (fused, plain)
    assert fused[-1] < fused[0]
