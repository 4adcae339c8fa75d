"""Beside the data path: joining episodes with the rest of a run's telemetry (W3C context across processes and HTTP, worker processes, logs, metrics, the run's resource)."""
