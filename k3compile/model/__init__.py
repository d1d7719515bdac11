"""The reference K3 model, written rank-local for tensor parallelism."""

from k3compile.model.k3 import K3ForCausalLM, count_parameters

__all__ = ["K3ForCausalLM", "count_parameters"]
