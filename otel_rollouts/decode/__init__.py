"""Feeding stage in front of recording: token-id batches decoded into chat messages and tool calls (lazily, only for kept episodes)."""
