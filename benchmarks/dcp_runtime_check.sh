#!/usr/bin/env bash
# End to end on two GPUs (NCCL, CUDA graphs): tiny-h24 (24 MLA heads: 12 per rank at TP2,
# as K3 at TP8) compiled for h200 at TP2 with DCP1 and DCP2 (split_mla_context, then
# pad_attention_heads pads the 24 gathered heads to 32) by either merge, greedy tokens must
# be equal.
#   bash benchmarks/dcp_runtime_check.sh WORKDIR
set -euo pipefail
W=${1:?usage: dcp_runtime_check.sh WORKDIR}
mkdir -p "$W"
k3compile init-model "$W/model" --preset tiny-h24 > /dev/null
PROMPTS=(--prompt "5 9 100 7 3 44 21 8 8 9 61" --prompt "300" --prompt "17 4")
for v in 1 2 2a; do  # DCP1; DCP2 with the reduce-scatter merge; DCP2 with the all-to-all merge
  merge=$([ "$v" = 2a ] && echo all-to-all || echo reduce-scatter)
  k3compile optimize "$W/model" -o "$W/dcp$v" --tp 2 --dcp "${v:0:1}" --dcp-merge "$merge" --target h200 \
    --dtype float32 --overwrite > "$W/optimize$v.log"
  python3 -m torch.distributed.run --nproc-per-node 2 "$(dirname "$0")/run_with_stack_dump.py" run "$W/dcp$v" "${PROMPTS[@]}" \
    --max-new-tokens 32 --max-context 256 > "$W/run$v.log" 2>&1
  grep "new tokens" "$W/run$v.log" > "$W/tokens$v.txt"
  grep "timing" "$W/run$v.log" || true
done
grep -c "split_mla_context" "$W/optimize2.log" > /dev/null
for v in 2 2a; do
  if diff "$W/tokens1.txt" "$W/tokens$v.txt"; then
    echo "DCP$v tokens equal DCP1 ($(wc -l < "$W/tokens1.txt") prompts x 32 tokens)"
  else
    echo "DCP$v tokens differ from DCP1"; exit 1
  fi
done
