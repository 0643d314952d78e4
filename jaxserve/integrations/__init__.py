"""What research code builds on jaxserve with: the rollout loop of RL training (rollout.py)."""
