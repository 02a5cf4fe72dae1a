"""Model files written against other mpu APIs (Megatron v2.6, Megatron v1 / CPM-Pretrain)."""
