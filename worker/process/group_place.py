"""Where a process stands in a worker group, as `mlx.launch` tells it (no MLX here: the
worker's I/O process reads it too)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupPlace:
    """This process's place in the group, as `mlx.launch` tells it."""

    rank: int
    hosts: tuple[str, ...]  # each rank's address, rank 0 first

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def leader(self) -> str:
        return self.hosts[0]

    @classmethod
    def from_environment(cls) -> GroupPlace | None:
        """None outside `mlx.launch` (no MLX_RANK / MLX_HOSTFILE)."""
        rank, hostfile = os.environ.get("MLX_RANK"), os.environ.get("MLX_HOSTFILE")
        if rank is None or hostfile is None:
            return None
        with open(hostfile) as file:
            hosts = json.load(file)
        return cls(int(rank), tuple(str(entry[0]).rsplit(":", 1)[0] for entry in hosts))

    def describe(self, mode: str) -> dict[str, object]:
        """What the heartbeat says of the group."""
        return {"mode": mode, "ranks": self.size, "hosts": list(self.hosts)}
