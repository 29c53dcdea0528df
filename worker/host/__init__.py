"""The host of several models: which models a worker loads and unloads, the worker
processes that serve them, and what it publishes of them for the fleet."""
