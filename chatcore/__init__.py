"""chatcore: a multi-session chat server with a paged, shared, persistent KV cache."""

from chatcore import import_noise
from chatcore.kernels import cpu_kind

__version__ = "0.1.0"

import_noise.install()
cpu_kind.forward_to_torch()  # CHATCORE_CPU_ISA below this CPU caps torch's own kernels too
