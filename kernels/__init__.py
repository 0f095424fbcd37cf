"""Paged attention kernels (Triton) and their torch references.

`__version__` must stay a PEP 440 version below 0.18: transformers probes for a package
named `kernels` and compares its version.
"""

__version__ = "0.1.0"
