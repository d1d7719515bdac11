"""Instructions in the main loop of a routed-expert kernel, from its sm_90 SASS (no GPU needed).

    python benchmarks/moe_sass.py                          # the default plans' w13 / w2 kernels
    python benchmarks/moe_sass.py --plan pair:16:16,128,4,4:64,128,4,3   # any plan (moe_probe.py syntax)

Compiles the kernels a plan launches at one TP8 rank's shapes for sm_90 (Triton's bundled
``ptxas``), disassembles them with the ``cuobjdump`` Triton ships, and prints for the
longest loop: instructions per thread per K step, per weight (both weights of w13), and the
most frequent opcodes. Whether the warps of a program decode the same weights shows as
instructions per weight that grow with the warp count.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from dataclasses import replace

import triton

from k3compile.runtime.kernels import aot, moe
from moe_probe import parse_plan

_ADDRESS = re.compile(r"\s+/\*([0-9a-f]{4})\*/")


def main_loop(sass: str) -> list[str]:
    """The instructions between the target and the source of the longest backward branch."""
    lines = [x for x in sass.splitlines() if _ADDRESS.match(x)]
    span = (0, -1)
    for x in lines:
        m = re.search(r"BRA 0x([0-9a-f]+)", x)
        here = int(_ADDRESS.match(x).group(1), 16)
        if m and int(m.group(1), 16) < here and here - int(m.group(1), 16) > span[1] - span[0]:
            span = (int(m.group(1), 16), here)
    return [x for x in lines if span[0] <= int(_ADDRESS.match(x).group(1), 16) <= span[1]]


def opcode(line: str) -> str:
    """LDGSTS of ``/*03b0*/  @!P1 LDGSTS.E [R81], ...``."""
    tokens = _ADDRESS.sub("", line).split()
    return (tokens[1] if tokens[0].startswith("@") else tokens[0]).split(".")[0]


def sass_of(launch: aot.KernelLaunch) -> str:
    compiled = aot._triton_compile(launch.request("sm_90"))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", path], capture_output=True, text=True,
                              check=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default=None, help="a plan in moe_probe.py's syntax (default: the sm_90 plans)")
    args = ap.parse_args()
    if args.plan:
        plan = parse_plan(args.plan)
        table = moe.PLANS["sm_90"]
        moe.PLANS["sm_90"] = replace(table, **{"grouped" if plan.grouped else "pair": plan})
        keep = ("w13_grouped_", "w2_grouped_") if plan.grouped else ("w13_pair", "w2_pair")
    else:
        keep = ("w13_", "w2_")
    for launch in moe.aot_requests("sm_90"):
        if not launch.name.startswith(keep):
            continue
        body = main_loop(sass_of(launch))
        ops = collections.Counter(opcode(x) for x in body)
        c = launch.constexprs
        weights = (2 if c["GLU"] else 1) * c["BLOCK_N"] * c["BLOCK_K"] / (32 * launch.num_warps)
        print(f"{launch.name}: {len(body)} instructions per thread per K step, "
              f"{len(body) / weights:.1f} per weight; {', '.join(f'{k} {v}' for k, v in ops.most_common(8))}")


if __name__ == "__main__":
    main()
