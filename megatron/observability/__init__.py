"""What a run tells its user: the log lines, progress, start-up phases,
metrics writers (TensorBoard, W&B), the closing summary and plots."""
