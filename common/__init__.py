"""What the worker and the gateway share, below both and below the command line:
settings in layers (`settings_layers`) and logging (`logs`). Needs pydantic-settings and
structlog, which both extras install; the client never imports it."""
