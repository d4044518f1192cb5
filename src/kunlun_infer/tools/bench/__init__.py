"""Offline benchmarking: a seeded workload, one measured run, sweeps over a config key, the knee, the plot."""
