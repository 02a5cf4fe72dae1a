"""The start-up line (megatron/observability/startup_times.py): each timed phase with its time, the rest
what the process spent before and between them, the total from the process start."""
import re
import time

from megatron.observability.startup_times import StartupTimes, process_age


def test_phases_and_the_rest_add_up_to_the_process_age():
    clock = StartupTimes()
    waits = {"fused kernels": 0.15, "datasets": 0.05}
    for label, seconds in waits.items():
        with clock.phase(label):
            time.sleep(seconds)
    time.sleep(0.05)  # between phases: counted in the rest
    line = clock.summary()
    age = process_age()
    found = re.fullmatch(r"> start-up: ([0-9.]+) s from process start to the end of the first "
                         r"step: fused kernels ([0-9.]+) s, datasets ([0-9.]+) s, the rest "
                         r"([0-9.]+) s \(imports, settings, torch.distributed\)", line)
    assert found, line
    total, kernels, data, rest = map(float, found.groups())
    assert kernels >= 0.15 and data >= 0.05 and rest >= 0.05
    assert abs(total - (kernels + data + rest)) <= 0.2  # each rounded to 0.1 s
    assert abs(total - age) < 1.0  # the whole process, imports included
    assert clock.seconds("datasets") >= 0.05 and clock.seconds("model") is None
