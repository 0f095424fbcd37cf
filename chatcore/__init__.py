"""chatcore: a multi-session chat server with a paged, shared, persistent KV cache."""

__version__ = "0.1.0"
