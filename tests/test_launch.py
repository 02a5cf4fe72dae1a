"""examples/run_gpt2.sh as users run it: one node, two nodes on one machine, DeepSpeed launcher."""
import pytest

from launch_runs import finish, free_port, launch, launch_env, log_losses


@pytest.mark.slow
def test_two_nodes_on_one_machine_match_one_node(gpt2_data, gpt2_one_node_losses, tmp_path):
    one = gpt2_one_node_losses
    port = str(free_port())
    # and the script's PIPELINE_SCHEDULE reaches the run: ZB-H1 (split backward) takes the
    # very steps of 1F1B in fp32 (the deferred weight GEMMs are bit-identical)
    nodes = [launch(launch_env(gpt2_data, tmp_path / "two", GPUS_PER_NODE="2", NNODES="2",
                               NODE_RANK=str(rank), MASTER_PORT=port,
                               PIPELINE_SCHEDULE="zb-h1")) for rank in (0, 1)]
    outputs = finish(nodes)
    two = log_losses(outputs)
    assert len(one) == 6 and one[-1] < one[0]
    assert two == one  # same layout, same seeds: identical losses
    assert any("pipeline schedule: zb-h1" in text for text in outputs), "the log names it"


@pytest.mark.slow
def test_deepspeed_launcher_matches_torchrun(gpt2_data, gpt2_one_node_losses, tmp_path):
    # One node: the DeepSpeed launcher starts the ranks itself (a hostfile needs ssh).
    env = launch_env(gpt2_data, tmp_path, LAUNCHER="deepspeed")
    assert log_losses(finish([launch(env)])) == gpt2_one_node_losses  # torchrun's
