"""structlog set-up: console lines for people, JSON lines for log collectors."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(log_format: str = "console", level: str = "info") -> None:
    """Configure structlog once per process; logs go to stderr."""
    renderer = (structlog.processors.JSONRenderer() if log_format == "json"
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
