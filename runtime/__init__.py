"""Artifact loading, caches and distributed execution (installed as ``k3compile.runtime``).

    from k3compile import runtime
    rt = runtime.load("out/tiny-k3.k3c")          # rank/world from torchrun, or arguments
    rt.generate([[1, 2, 3]], max_new_tokens=16, sampling=runtime.SamplingParams(temperature=0.7, top_p=0.9))
"""

from k3compile.runtime.engine import RequestError, Runtime, RuntimeOptions, load
from k3compile.runtime.sampling import SamplingParams, sample

__all__ = ["RequestError", "Runtime", "RuntimeOptions", "SamplingParams", "load", "sample"]
