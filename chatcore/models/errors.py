"""Why a model cannot be served. Each message is one line, which the command line prints as is
(exit code 2), as it does for a missing device."""

from __future__ import annotations


class ModelUnavailable(Exception):
    """The model asked for cannot be served; the message says why, in one line."""


class ModelNotFound(ModelUnavailable, FileNotFoundError):
    """Neither a local model folder nor a hub id found in the local Hugging Face cache (or downloaded)."""


class UnsupportedModel(ModelUnavailable):
    """The model's attention is something the paged path would not reproduce exactly."""
