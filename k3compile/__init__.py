"""k3compile: a compiler for serving Kimi K3.

Importing the package registers the ``k3::`` op library.
"""

__version__ = "0.1.0"

from k3compile import ops as _ops  # noqa: F401  (registers torch.ops.k3.*)
