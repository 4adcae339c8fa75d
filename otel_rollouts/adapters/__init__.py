"""Adapters: the rollout data RL frameworks already have, recorded as episode traces."""
