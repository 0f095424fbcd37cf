"""`chatcore serve`: uvicorn on the configured host and port."""

from __future__ import annotations

import ipaddress
import logging
import re

import uvicorn

from chatcore.config import Settings
from chatcore.server.app import create_app

log = logging.getLogger("chatcore")


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
      log one warning line instead of an ERROR with a traceback that any client could repeat at will."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, str) and "api_key=" in a for a in record.args):
            record.args = tuple(SECRET_QUERY.sub(r"\1[redacted]", a) if isinstance(a, str) else a
                                for a in record.args)
        if isinstance(record.msg, str) and record.msg.startswith("Invalid UTF-8 sequence received from client"):
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = "a client sent a text frame that is not UTF-8; closed with 1007"
        return True


SECRET_QUERY = re.compile(r"((?:^|[?&])api_key=)[^&\s\"]*")


def serve_command(settings: Settings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _is_loopback(settings.host):
        log.warning("binding to %s: with no API key configured (open mode) anyone who can reach this address "
                    "can use the server; create keys with `chatcore keys create --tenant NAME`", settings.host)
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            ws_max_size=settings.max_frame_bytes * 4, timeout_graceful_shutdown=10)
    hygiene = LogHygiene()  # after uvicorn's logging configuration (Config sets it up)
    for name in ("uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).addFilter(hygiene)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 3  # as uvicorn.run exits when start-up fails
