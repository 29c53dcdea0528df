"""The mlxq worker daemon: `mlxq worker` (see `worker.cli`)."""
