"""k3compile: a compiler for serving Kimi K3.

The package root is light (no torch import), so that ``k3compile --help`` answers at
once. The ``k3::`` op library registers when ``k3compile.ops`` is imported: every module
that calls ``torch.ops.k3.*`` imports it (the model, the passes, the artifact loader).
"""

__version__ = "0.1.0"
