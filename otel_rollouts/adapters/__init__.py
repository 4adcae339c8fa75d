"""Adapters: the rollout data RL frameworks already have, recorded as episode traces.

Each framework's adapter is written with ``otel_rollouts.adapters.kit``, the public adapter kit
(its docstring says how to write one), and the public ``otel_rollouts`` API.
"""
