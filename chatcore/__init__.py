"""chatcore: a multi-session chat server with a paged, shared, persistent KV cache."""

from chatcore import import_noise

__version__ = "0.1.0"

import_noise.install()
