"""Warnings that importing torchao logs and that concern nothing chatcore runs, filtered out.

transformers imports torchao (a requirement: `weights=int8`) whenever it is installed, as soon as
its model code is imported, whatever the weights. With a CPU build of torch that import logs one
warning per CUDA extension it cannot load (`torchao` logger), and torch logs that torchao registers
enums for pytrees in a deprecated way (`torch.utils._pytree`, through torch's own handler: a line
that is not JSON in a `log_format=json` server's log). Exactly those records are dropped; everything
else those loggers say passes. `chatcore/__init__.py` installs the filters, before anything imports
transformers.
"""

from __future__ import annotations

import logging


class _Drop(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not all(fragment in text for fragment in self.fragments)


FILTERS = {
    "torchao": _Drop("Failed to load ", "_C"),
    "torch.utils._pytree": _Drop("is an Enum subclass", "register_constant()"),
}


def install() -> None:
    """Add the filters (once each) to their loggers."""
    for name, dropped in FILTERS.items():
        logger = logging.getLogger(name)
        if dropped not in logger.filters:
            logger.addFilter(dropped)
