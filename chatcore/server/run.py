"""`chatcore serve`: uvicorn on the configured host and port."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import sys

import uvicorn
from sqlalchemy.exc import DBAPIError

from chatcore import openmp
from chatcore.config import Settings
from chatcore.logs import configure_logging
from chatcore.store.db import create_engine, create_sessionmaker
from chatcore.store.repos import Repos

log = logging.getLogger("chatcore")
# The device failed while serving (an illegal memory access, a launch failure): the engine stopped, the
# server shut down, and a supervisor should start a fresh process.
EXIT_DEVICE_LOST = 4


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LogHygiene(logging.Filter):
    """What uvicorn logs, made safe to keep:
    - secrets in query strings (`?api_key=` is how browsers authenticate a WebSocket) are redacted from the
      access lines of HTTP requests and WebSocket upgrades;
    - a client's text frame that is not UTF-8 is the client's fault: uvicorn closes the socket (1007), and we
      log one warning line instead of an ERROR with a traceback that any client could repeat at will;
    - a start that failed its warm-up (`startup_failure`, the exception's qualified name) was logged in one
      line by the services: uvicorn's copy of the traceback is dropped."""

    def __init__(self, startup_failure: str) -> None:
        super().__init__()
        self.startup_failure = startup_failure

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error" and isinstance(record.msg, str) and self.startup_failure in record.msg:
            return False
        if isinstance(record.args, tuple) and any(isinstance(a, str) and "api_key=" in a for a in record.args):
            record.args = tuple(SECRET_QUERY.sub(r"\1[redacted]", a) if isinstance(a, str) else a
                                for a in record.args)
        if isinstance(record.msg, str) and record.msg.startswith("Invalid UTF-8 sequence received from client"):
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = "a client sent a text frame that is not UTF-8; closed with 1007"
        return True


SECRET_QUERY = re.compile(r"((?:^|[?&])api_key=)[^&\s\"]*")


def open_mode_exposure(settings: Settings) -> str | None:
    """Why a server without keys (open mode) would answer other machines; None when it would not."""
    if not _is_loopback(settings.host):
        return f"it binds to {settings.host}"
    outside = [h for h in settings.allowed_hosts if h == "*" or not _is_loopback(h.strip("[]"))]
    return f"CHATCORE_ALLOWED_HOSTS names {', '.join(outside)}" if outside else None


async def _has_keys(settings: Settings) -> bool:
    """Whether any API key exists; a database not created or not migrated yet has none."""
    db = create_engine(settings.resolved_database_url)
    try:
        async with create_sessionmaker(db)() as session:
            return await Repos(session).keys.count_keys() > 0
    except DBAPIError:
        return False
    finally:
        await db.dispose()


def serve_command(settings: Settings) -> int:
    configure_logging(settings.log_format)
    if settings.log_format == "json":  # every line JSON: transformers' records to the root, no progress bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
        hf_logging.disable_progress_bar()
    exposure = open_mode_exposure(settings)
    if exposure and not settings.insecure_open_mode and not asyncio.run(_has_keys(settings)):
        print(f"chatcore serve: no API key exists (open mode: no access control) and {exposure}; create one with "
              "`chatcore keys create --tenant NAME`, or pass --insecure-open-mode", file=sys.stderr)
        return 2
    if exposure:
        log.warning("%s: without API keys (open mode) anyone who can reach this server can use it", exposure)
    # Imported here: a refusal above answers before the seconds that transformers takes to import.
    from chatcore.engine.warmup import NotReady
    from chatcore.models.loader import load_model
    from chatcore.server.app import create_app
    from chatcore.server.connections import guarded_http_protocol

    # Loaded before anything binds: a model refused at load (models/support.py) is one line and exit 2.
    lost: list[str] = []

    def device_lost(cause: str) -> None:  # on the event loop (the engine's `DeviceLost`): uvicorn's reads should_exit
        lost.append(cause)
        server.should_exit = True

    app = create_app(settings, load_model(settings), on_device_lost=device_lost)
    openmp.single_threaded()  # the event loop's thread: the engine's thread computes (chatcore/openmp.py)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            log_config=None,  # uvicorn's records go to the root logger's format
                            ws_max_size=settings.max_frame_bytes * 4, timeout_graceful_shutdown=10,
                            limit_concurrency=settings.max_connections,  # chatcore/server/connections.py
                            http=guarded_http_protocol(settings.header_timeout_s, settings.body_timeout_s))
    hygiene = LogHygiene(f"{NotReady.__module__}.{NotReady.__qualname__}")  # after uvicorn's logging set-up
    for name in ("uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).addFilter(hygiene)
    server = uvicorn.Server(config)
    server.run()
    if lost:
        return EXIT_DEVICE_LOST
    return 0 if server.started else 3  # as uvicorn.run exits when start-up fails (the warm-up's failure too)
