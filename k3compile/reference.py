"""Reference execution: prefill and incremental decode of a batch of sequences on one rank.

Sequences of different lengths share one set of caches: each holds a KDA state slot
(conv + fp32 recurrent state, zeroed when the sequence starts) and a list of MLA cache
blocks that grows as it does. A step packs the new tokens of several sequences
(prefill: any number per sequence, also continuing a sequence; decode: one each) into a
:class:`Batch` and runs the rank-local model eagerly. With TP > 1 every rank runs the
same engine on the same requests (SPMD) and gets the same logits.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from k3compile.batch import CacheShape, allocate_caches, zero_state_slot
from k3compile.checkpoint.loader import CheckpointError, load_checkpoint_config, load_weights
from k3compile.config import K3Config
from k3compile.device_memory import GiB, available_bytes
from k3compile.distributed import TPGroup
from k3compile.model import K3ForCausalLM
from k3compile.sequences import RequestError, Sequence, SequenceTable, generate_tokens
from k3compile.sharding import ParallelPlan, fill_rank_constants

__all__ = ["ReferenceEngine", "RequestError", "load_reference"]


class ReferenceEngine:
    """Eager prefill/decode/generate over the reference model with real caches."""

    def __init__(self, model: K3ForCausalLM, cache_shape: CacheShape, device: torch.device | str = "cpu"):
        self.model = model
        self.cfg: K3Config = model.config
        self.shape = cache_shape
        self.device = torch.device(device)
        self.caches = allocate_caches(self.cfg, model.plan, cache_shape, model.dtype, self.device)
        self.table = SequenceTable(self.cfg.vocab_size, cache_shape)

    @property
    def sequences(self) -> dict[int, Sequence]:
        return self.table.sequences

    def new_sequence(self) -> int:
        seq_id = self.table.new_sequence()
        zero_state_slot(self.caches, self.table.sequences[seq_id].slot)
        return seq_id

    def release(self, seq_id: int) -> None:
        self.table.release(seq_id)

    # ----- steps ----------------------------------------------------------------
    @torch.no_grad()
    def step(self, seq_ids: list[int], tokens: list[list[int]], all_logits: bool = False) -> Tensor:
        """Run the new ``tokens`` of each sequence; returns fp32 logits of the last token of
        each sequence [N, V] (or of every new token, [T, V], with ``all_logits``)."""
        self.table.check_step(seq_ids, tokens)
        counts = [len(t) for t in tokens]
        self.table.reserve(seq_ids, counts)
        decode = all(n == 1 for n in counts)
        batch = self.table.make_batch(seq_ids, counts, decode, all_logits, self.device)
        ids = torch.tensor([t for toks in tokens for t in toks], dtype=torch.int64, device=self.device)
        logits = self.model(ids, batch, self.caches)
        self.table.advance(seq_ids, counts)
        return logits

    def prefill(self, prompts: list[list[int]], all_logits: bool = False) -> tuple[list[int], Tensor]:
        """Start one sequence per prompt and prefill them in one packed step."""
        self.table.check_new(prompts)
        ids = [self.new_sequence() for _ in prompts]
        try:
            return ids, self.step(ids, prompts, all_logits)
        except RequestError:
            for s in ids:
                self.release(s)
            raise

    def decode(self, seq_ids: list[int], tokens: list[int]) -> Tensor:
        return self.step(seq_ids, [[t] for t in tokens])

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generation; returns the new tokens of each prompt."""
        return generate_tokens(self, prompts, max_new_tokens, lambda logits: logits.argmax(-1).tolist()).tokens


def load_reference(
    model_dir: str | Path,
    plan: ParallelPlan = ParallelPlan(),
    tp: TPGroup | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> K3ForCausalLM:
    """Build the rank-local model for ``plan`` and load its slice of ``model_dir``.

    Before allocating anything, every tensor's header is checked against the config (a
    config edited to another size is a CheckpointError naming the first tensor that differs),
    and the model must fit ``device``'s free memory."""
    cfg = load_checkpoint_config(model_dir)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, plan, tp, dtype)
    load_weights(model, model_dir, plan, cfg.checkpoint_prefix)  # on meta: headers only
    need = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    free = available_bytes(torch.device(device))
    if free is not None and need > free:
        raise CheckpointError(f"{model_dir}: the reference model needs {need / GiB:.1f} GiB in {dtype} "
                              f"and {device} has {free / GiB:.1f} GiB free")
    model = model.to_empty(device=device)
    fill_rank_constants(model, plan)
    load_weights(model, model_dir, plan, cfg.checkpoint_prefix)
    return model.eval()
