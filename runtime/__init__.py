"""Artifact loading, kernels, caches and distributed execution (installed as ``k3compile.runtime``)."""
