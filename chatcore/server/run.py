"""`chatcore serve`: uvicorn on the configured host and port."""

from __future__ import annotations

import ipaddress
import logging

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


def serve_command(settings: Settings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _is_loopback(settings.host):
        log.warning("binding to %s: with no API key configured (open mode) anyone who can reach this address "
                    "can use the server; create keys with `chatcore keys create --tenant NAME`", settings.host)
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info",
                ws_max_size=settings.max_frame_bytes * 4, timeout_graceful_shutdown=10)
    return 0
