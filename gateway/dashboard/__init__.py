"""The dashboard: a live web view of the fleet, its queues, running requests, dead
letters, batches and the last hour, at `/dashboard` of a gateway (or of `mlxq dashboard`).
Server-rendered HTML and one small script; nothing is fetched from elsewhere."""
