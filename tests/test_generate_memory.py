"""The generator writes shard by shard: peak memory stays far below the checkpoint size."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, resource, sys
from k3compile.checkpoint.generate import GenerateOptions, generate_model_dir
from k3compile.config import PRESETS
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = PRESETS["tiny"].replace(hidden_size=1024, routed_expert_hidden_size=512, moe_intermediate_size=512,
                              intermediate_size=2048, num_experts=64, vocab_size=8192, pad_token_id=8191)
generate_model_dir(cfg, sys.argv[1], GenerateOptions(shard_bytes=16 << 20))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"base_kib": base, "peak_kib": peak}))
"""


def test_generator_peak_memory_is_bounded_by_shard_size(tmp_path):
    out = tmp_path / "medium"
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, check=True)
    rss = json.loads(result.stdout.strip().splitlines()[-1])
    total = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    grown = (rss["peak_kib"] - rss["base_kib"]) * 1024
    assert total > 300 << 20, total  # the checkpoint is large...
    assert grown < total / 3, (grown, total)  # ...and was never held in memory at once
