"""The pass contract, the pass registry and the pass pipeline.

A pass is one class in one file of ``passes/`` that registers itself
(:func:`register_pass`) with its ``name``, a typed ``Config`` dataclass, and what the
pipeline selects and orders it by: the device kinds it runs on by default
(``default_on``), the passes it must follow or precede (``after`` / ``before``), the
plans that cannot run without it (``required_by``) and the graph facts it reads
(``needs``). ``run(gm, ctx) -> PassResult`` rewrites the graph of one phase in place and
reports what it did: whether it changed anything, how many candidates it matched, named
stats (:data:`STANDARD_STATS` plus its own), and every candidate it skipped with the
reason.

One module per concept:

* :mod:`~k3compile.pipeline.interface`: ``GraphPass``, ``PassContext``, ``register_pass``;
* :mod:`~k3compile.pipeline.selection`: which passes run, in which order, with which
  configs (:func:`resolve_passes`, :func:`pass_config`, :func:`config_choices`);
* :mod:`~k3compile.pipeline.graph_edits`: parameter and rank-constant edits for passes;
* :mod:`~k3compile.pipeline.run`: :func:`run_pipeline` and its after-pass checks.
"""

from k3compile.pipeline.graph_edits import add_parameter, add_rank_constant, remove_parameter, reshard_parameter
from k3compile.pipeline.interface import (
    GRAPH_FACTS,
    PASSES,
    STANDARD_STATS,
    GraphPass,
    NoConfig,
    PassContext,
    PassError,
    PassResult,
    Rewrite,
    Skipped,
    register_pass,
)
from k3compile.pipeline.run import (
    PipelineResult,
    count_ops,
    lint_graph,
    propagate_shapes,
    run_pipeline,
    sync_signature,
)
from k3compile.pipeline.selection import (
    PipelineOptions,
    config_choices,
    default_pass_names,
    pass_class,
    pass_config,
    pass_configs,
    pipeline_order,
    registered_passes,
    resolve_passes,
)

__all__ = [
    "GRAPH_FACTS", "PASSES", "STANDARD_STATS", "GraphPass", "NoConfig", "PassContext", "PassError", "PassResult",
    "PipelineOptions", "PipelineResult", "Rewrite", "Skipped", "add_parameter", "add_rank_constant", "config_choices",
    "count_ops", "default_pass_names", "lint_graph", "pass_class", "pass_config", "pass_configs", "pipeline_order",
    "propagate_shapes", "register_pass", "registered_passes", "remove_parameter", "reshard_parameter", "resolve_passes",
    "run_pipeline", "sync_signature",
]
