#!/usr/bin/env bash
# Issue #26: the whole decode step and the time to first token on two GPUs (NCCL, CUDA
# graphs) at one TP8 rank's per-GPU shapes. k3-tp8-rank-x2 (4 layers, MXFP4 experts: two
# TP8 ranks as one model) compiled at --tp 2 with every pass, once plain and once with
# --dcp 2 --kv-cache-dtype fp8; for each: `k3compile plan` (per-GPU memory as planned),
# `k3compile bench` under torchrun (step time against the floor, the device memory each
# rank holds, one step by kernel with the collectives' share), and the greedy tokens of a
# few prompts against the same weights compiled at --tp 1 on one GPU.
#
#   bash benchmarks/tp2_step.sh WORKDIR
#
# What WORKDIR already holds (the model, artifacts, bench results, tokens) is kept, so a
# second call continues a first that ran out of time. The defaults are the issue's; the variables below shrink it, e.g.
# a CPU check with gloo:
#   PRESET=tiny-h24 TARGET=cpu DTYPE=float32 DEVICE=cpu BATCHES=1,2 CONTEXTS=64 PROMPT_LENS=16 \
#     bash benchmarks/tp2_step.sh /tmp/tp2
set -euo pipefail
W=${1:?usage: tp2_step.sh WORKDIR}
PRESET=${PRESET:-k3-tp8-rank-x2}
TARGET=${TARGET:-h200}
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}
BATCHES=${BATCHES:-1,16,64}
CONTEXTS=${CONTEXTS:-1024,32768,131072}
PROMPT_LENS=${PROMPT_LENS:-4096}
NEW_TOKENS=${NEW_TOKENS:-16}
HERE=$(cd "$(dirname "$0")" && pwd)
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 2 "$HERE/run_with_stack_dump.py")
PROMPTS=(--prompt "5 9 100 7 3 44 21 8 8 9 61" --prompt "300" --prompt "17 4 17 4 17 4")
max() { tr , '\n' <<< "$1" | sort -n | tail -1; }

mkdir -p "$W"
[ -d "$W/model" ] || k3compile init-model "$W/model" --preset "$PRESET" > "$W/init.log"
for v in tp1 tp2 tp2-dcp2-fp8 tp1-fp8; do
  case $v in
    tp1) args=(--tp 1) ;;
    tp2) args=(--tp 2) ;;
    tp2-dcp2-fp8) args=(--tp 2 --dcp 2 --kv-cache-dtype fp8) ;;
    tp1-fp8) args=(--tp 1 --kv-cache-dtype fp8) ;;
  esac
  [ -d "$W/$v" ] || k3compile optimize "$W/model" -o "$W/$v" "${args[@]}" --target "$TARGET" --dtype "$DTYPE" \
    > "$W/optimize-$v.log"
  run=(k3compile run "$W/$v" "${PROMPTS[@]}" --max-new-tokens "$NEW_TOKENS" --max-context 256 --device "$DEVICE")
  if [[ $v == tp2* && ! -f "$W/bench-$v.json" ]]; then
    k3compile plan "$W/model" "${args[@]}" --target "$TARGET" --dtype "$DTYPE" --context "$(max "$CONTEXTS")" \
      --sequences "$(max "$BATCHES")" > "$W/plan-$v.txt"
    "${TORCHRUN[@]}" bench "$W/$v" --batch "$BATCHES" --context "$CONTEXTS" --prompt-len "$PROMPT_LENS" \
      --device "$DEVICE" --profile --json "$W/bench-$v.json" > "$W/bench-$v.txt" 2>&1
  fi
  if [ ! -s "$W/tokens-$v.txt" ]; then
    if [[ $v == tp2* ]]; then "${TORCHRUN[@]}" "${run[@]:1}" > "$W/run-$v.log" 2>&1; else "${run[@]}" > "$W/run-$v.log" 2>&1; fi
    grep "new tokens" "$W/run-$v.log" > "$W/tokens-$v.txt"
  fi
done
for pair in "tp2 tp1" "tp2-dcp2-fp8 tp1-fp8"; do
  set -- $pair
  if diff -q "$W/tokens-$1.txt" "$W/tokens-$2.txt" > /dev/null; then
    echo "$1: tokens equal $2's ($(wc -l < "$W/tokens-$2.txt") prompts x $NEW_TOKENS tokens)"
  else
    echo "$1: tokens differ from $2's"; diff "$W/tokens-$1.txt" "$W/tokens-$2.txt" || true
  fi
done
python3 - "$W" <<'EOF'
import json, sys
from pathlib import Path

for f in sorted(Path(sys.argv[1]).glob("bench-*.json")):
    data = json.loads(f.read_text())
    print(f"{f.stem}: memory {data['memory_gib']} GiB (rank 0)")
    for d in data["decode"]:
        total, collectives = d["kernels"][0], d["kernels"][1]
        share = collectives["ms"] / total["ms"] if total["ms"] else 0.0
        device = f"{d['device_ms']:.3f}" if d["device_ms"] is not None else "-"
        print(f"  batch {d['batch']:>3} context {d['context']:>7}: step {d['step_ms']:.3f} ms, device {device} ms, "
              f"floor {d['floor_ms']:.3f} ms, collectives {collectives['ms']:.3f} ms ({share:.0%} of one step's kernels)")
    for p in data["prefill"]:
        print(f"  prefill {p['prompt_len']} tokens: {p['ttft_ms']:.1f} ms")
EOF
