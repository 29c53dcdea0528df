"""The mlxq worker daemon, run by `mlxq worker` (`mlxq.cli`); `worker.daemon` starts its parts."""
