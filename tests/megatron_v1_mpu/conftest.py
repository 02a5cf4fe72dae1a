"""Megatron v1.0's mpu tests, ported: scripts run by tests/test_mpu_v1_ported.py on harness
ranks (each is a ``__main__`` program, as in Megatron v1.0), never collected by pytest."""
collect_ignore_glob = ["test_*.py"]
