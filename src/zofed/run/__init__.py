"""Experiment runner: config, centralized fine-tuning, checkpoints, metrics."""
