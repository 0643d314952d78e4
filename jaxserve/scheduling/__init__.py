"""Scheduling: which requests run how many tokens each step, on the host, without jax."""
