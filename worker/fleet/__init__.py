"""The fleet side: how a worker is seen by the others: its consumer name, its membership
and lease, its heartbeat, and its Prometheus metrics."""
