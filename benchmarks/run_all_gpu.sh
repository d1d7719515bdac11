#!/usr/bin/env bash
# Every GPU benchmark in one go (checks first inside each script), results under OUT.
#   bash benchmarks/run_all_gpu.sh OUT [name ...]     names: moe_layer rank_slice moe_tail sink_copies mla_decode kda_decode runtime dcp
# (dcp needs two GPUs; it is not in the default list)
set -uo pipefail
OUT=${1:?usage: run_all_gpu.sh OUT [name ...]}
shift
NAMES=${*:-moe_layer rank_slice moe_tail sink_copies mla_decode kda_decode runtime}
cd "$(dirname "$0")"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
for name in $NAMES; do
  case $name in
    moe_layer) cmd="python3 moe_layer.py --out $OUT" ;;
    rank_slice) cmd="python3 rank_slice_step.py --out $OUT/rank_slice" ;;
    moe_tail) cmd="python3 moe_tail_dedup.py --out $OUT/moe_tail" ;;
    sink_copies) cmd="python3 sink_copies.py --out $OUT/sink_copies" ;;
    mla_decode) cmd="python3 mla_decode.py --out $OUT/mla_decode" ;;
    kda_decode) cmd="python3 kda_decode.py --out $OUT/kda_decode" ;;
    runtime) cmd="python3 runtime_cuda_graphs.py --out $OUT/runtime" ;;
    dcp) cmd="python3 -m torch.distributed.run --nproc-per-node 2 dcp_attention.py --out $OUT/dcp" ;;
    *) echo "unknown benchmark $name"; exit 2 ;;
  esac
  echo "=== $name: $cmd"
  start=$(date +%s)
  $cmd 2>&1 | tee "$OUT/$name.log" || status=1
  echo "=== $name took $(( $(date +%s) - start )) s"
done
exit $status
