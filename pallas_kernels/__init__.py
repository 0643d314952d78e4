"""Pallas attention kernels, each beside a pure-jnp reference with the same signature."""
