"""Ahead-of-time compilation report for Triton kernels: does a kernel fit a GPU we lack?

CI has no GPU, but Triton's backends compile without one: ``triton.compile`` lowers a
``@triton.jit`` function for gfx950 / gfx942 (to AMDGCN and a code object) and for
sm_90 (to PTX and, with the bundled ``ptxas``, a cubin). This module compiles a kernel
for a named target and reports what the hardware would have to give it:

- shared memory (LDS on AMD): ``compiled.metadata.shared``, the bytes Triton allocates
  per program (it is dynamic LDS, so the code object's own
  ``.group_segment_fixed_size`` is 0 and cannot be used);
- registers and spills: on AMD from the code object metadata in the AMDGCN text
  (``.vgpr_count`` is the unified arch+acc VGPR count per lane that decides occupancy;
  spills are ``.vgpr_spill_count``, the VGPRs spilled to scratch memory: SGPR spills
  land in spare VGPR lanes and cost no memory traffic); on NVIDIA from ``cuobjdump
  -res-usage`` of the cubin (``REG`` registers per thread; ``STACK`` + ``LOCAL`` bytes
  of per-thread stack frame and local memory, which Triton kernels only use for spills
  (ptxas puts spills in the stack frame), reported as 32-bit words). ``None`` where the tool is missing: the report never guesses;
- occupancy (see :func:`occupancy`), and ``fits``: the shared memory one program needs
  is within what one workgroup / CTA may allocate, and at least one program fits a
  CU / SM.

    res = compile_for_target(kernel, {"x": "*bf16", "n": "i32", "BLOCK": "constexpr"},
                             {"BLOCK": 64}, "gfx950")
    assert res.fits, res

Kernels are compiled with the attributes Triton's JIT derives at launch (:func:`attributes`):
``tt.divisibility=16`` on every pointer (the caching allocators of torch return 256-byte
aligned storage) and on the integer arguments named in ``divisible_by_16``; on AMD
targets also ``tt.pointer_range=32`` (buffer loads and stores with 32-bit offsets) on
every pointer whose storage is under 2 GiB (at most 2^31 - 1 bytes), that is all but
``pointers_over_2gib`` (ROCm's JIT does so by default, ``knobs.amd.use_buffer_ops``; the
reports assume that default). Integers equal to 1, which the JIT makes constants, are
constants of the launch: :func:`specialised` derives both from a launch's integer values.

In a process where TRITON_INTERPRET was set before Triton was imported (CPU test runs)
nothing can be compiled in-process, so :func:`compile_many` (and compile_for_target)
compile in fresh subprocesses without it (one per core); batch requests to pay their
start-up once.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

KiB = 1024


@dataclass(frozen=True)
class TargetSpec:
    """One GPU's compile target and the per-CU/SM limits that occupancy depends on."""

    name: str  # "gfx950", "gfx942", "sm_90"
    device: str
    gpu_target: GPUTarget
    compute_units: int  # CUs (AMD) / SMs (NVIDIA)
    shared_per_unit_bytes: int  # LDS per CU / shared memory per SM
    shared_per_program_bytes: int  # most one workgroup / CTA may allocate
    register_file: int  # AMD: VGPRs per lane of a SIMD; NVIDIA: 32-bit registers per SM
    register_granule: int  # AMD: VGPRs per lane; NVIDIA: registers per warp
    max_resident: int  # AMD: waves per SIMD; NVIDIA: warps per SM
    max_programs_per_unit: int  # NVIDIA: CTAs per SM (AMD: limited by waves only)

    @property
    def is_amd(self) -> bool:
        return self.gpu_target.backend == "hip"


# Sources: AMD CDNA3 ISA guide and MI300X data sheet (304 CUs, 64 KiB LDS per CU,
# 4 SIMDs per CU, 512 unified VGPRs per lane per SIMD allocated in granules of 8,
# at most 8 waves per SIMD); AMD CDNA4 white paper and MI355X data sheet (256 CUs,
# LDS grown to 160 KiB per CU, same register file); NVIDIA H200 = GH100 with 132 SMs,
# 228 KiB shared memory per SM of which one CTA may use 227 KiB (the other KiB is
# reserved per CTA), 64K registers per SM allocated per warp in units of 256, at most
# 64 warps and 32 CTAs per SM (CUDA C Programming Guide, compute capability 9.0).
TARGETS: dict[str, TargetSpec] = {
    "gfx950": TargetSpec("gfx950", "AMD Instinct MI355X", GPUTarget("hip", "gfx950", 64), 256,
                         160 * KiB, 160 * KiB, 512, 8, 8, 0),
    "gfx942": TargetSpec("gfx942", "AMD Instinct MI300X", GPUTarget("hip", "gfx942", 64), 304,
                         64 * KiB, 64 * KiB, 512, 8, 8, 0),
    "sm_90": TargetSpec("sm_90", "NVIDIA H200", GPUTarget("cuda", 90, 32), 132,
                        228 * KiB, 227 * KiB, 64 * KiB, 256, 64, 32),
}

_NV_RESERVED_SHARED_PER_CTA = 1 * KiB


@dataclass(frozen=True)
class KernelResources:
    """What one compiled program of ``kernel`` needs on ``target``."""

    kernel: str
    target: str
    num_warps: int
    shared_bytes: int  # LDS / shared memory per program
    shared_limit_bytes: int  # most one program may allocate on the target
    registers: int | None  # VGPRs per lane (AMD) / registers per thread (NVIDIA)
    spills: int | None  # registers spilled to memory (AMD: VGPRs to scratch; NVIDIA: 32-bit words of local memory)
    occupancy: int | None  # waves per SIMD (AMD) / warps per SM (NVIDIA); see occupancy()

    @property
    def fits(self) -> bool:
        """The program can be launched: its shared memory is within the per-program limit
        (and, when registers are known, at least one program is resident per CU/SM)."""
        return self.shared_bytes <= self.shared_limit_bytes and self.occupancy != 0

    @property
    def programs_per_unit(self) -> int | None:
        """Programs resident per CU / SM: AMD reports waves per SIMD (4 SIMDs a CU, a
        workgroup's waves spread over them), NVIDIA warps per SM."""
        if self.occupancy is None:
            return None
        return self.occupancy * (4 if TARGETS[self.target].is_amd else 1) // self.num_warps

    def __str__(self) -> str:
        return (f"{self.kernel}@{self.target}: warps={self.num_warps} "
                f"shared={self.shared_bytes}/{self.shared_limit_bytes} B regs={self.registers} "
                f"spills={self.spills} occupancy={self.occupancy} fits={self.fits}")


def occupancy(spec: TargetSpec, num_warps: int, shared_bytes: int, registers: int | None) -> int | None:
    """Resident waves per SIMD (AMD) or warps per SM (NVIDIA), the usual calculator.

    AMD: a workgroup's ``num_warps`` waves spread over the CU's 4 SIMDs, so
        waves/SIMD = min(8, 512 // roundup(VGPRs, 8), (LDS_per_CU // LDS) * num_warps // 4)
    NVIDIA: CTAs/SM = min(32, 64 // num_warps, (65536 // roundup(32 * regs, 256)) // num_warps,
                          228 KiB // (shared + 1 KiB reserved per CTA));  warps/SM = CTAs * num_warps
    ``None`` when the register count is unknown.
    """
    if registers is None:
        return None
    if spec.is_amd:
        alloc = -(-max(registers, 1) // spec.register_granule) * spec.register_granule
        by_regs = spec.register_file // alloc
        by_lds = (spec.shared_per_unit_bytes // shared_bytes) * num_warps // 4 if shared_bytes else spec.max_resident
        return min(spec.max_resident, by_regs, by_lds)
    per_warp = -(-32 * max(registers, 1) // spec.register_granule) * spec.register_granule
    ctas = min(
        spec.max_programs_per_unit,
        spec.max_resident // num_warps,
        (spec.register_file // per_warp) // num_warps,
        spec.shared_per_unit_bytes // (shared_bytes + _NV_RESERVED_SHARED_PER_CTA),
    )
    return ctas * num_warps


@dataclass(frozen=True)
class CompileRequest:
    """One kernel specialisation to compile for one target (see compile_for_target)."""

    fn: object
    signature: dict[str, str | tuple[str, ...]]  # a tuple: the element types of a tuple argument
    constexprs: dict[str, object]
    target: str
    num_warps: int = 4
    num_stages: int = 1
    divisible_by_16: tuple[str, ...] = ()
    #: pointer arguments whose storage exceeds 2 GiB at the launch's shapes (a layer's cache
    #: pool at K3's serving sizes): ROCm's JIT leaves them 64-bit (see the module docstring)
    pointers_over_2gib: tuple[str, ...] = ()
    #: a cap on registers per thread (Triton's ``maxnreg``; NVIDIA targets only)
    max_registers: int | None = None


@dataclass(frozen=True)
class AsmRequest:
    """The compiled text of one request: ``kind`` "ptx" (NVIDIA), "amdgcn" (AMD), "ttgir", ...
    For tests that check what the compiler made of a kernel (the order of its memory operations)."""

    request: CompileRequest
    kind: str


#: Triton's names of the activation and FP8 cache dtypes the launchers take
TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                 torch.float8_e4m3fn: "fp8e4nv", torch.float8_e4m3fnuz: "fp8e4b8"}


def launch_signature(fn: JITFunction, types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    """Every argument of ``fn``: "constexpr" for ``constexprs``, its type from ``types``,
    else "i32" (the integer sizes and strides)."""
    return {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel specialisation as a launcher runs it (the kernel modules list theirs so
    that CI compiles exactly what runs): :meth:`request` makes it a CompileRequest."""

    name: str
    fn: object
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int = 1
    #: integer arguments that are multiples of 16 at K3's shapes: Triton's JIT specialises
    #: them so at launch (it sizes the cache loads' vectors, hence cp.async, from them)
    divisible_by_16: tuple[str, ...] = ()
    #: pointer arguments over 2 GiB at K3's serving shapes (CompileRequest)
    pointers_over_2gib: tuple[str, ...] = ()
    #: the launch's register cap (CompileRequest)
    max_registers: int | None = None

    def request(self, target: str) -> CompileRequest:
        return CompileRequest(self.fn, self.signature, self.constexprs, target, self.num_warps, self.num_stages,
                              self.divisible_by_16, self.pointers_over_2gib, self.max_registers)

    @property
    def key(self) -> tuple:
        """What tells two specialisations apart (hashable): equal keys compile alike."""
        return (self.name, tuple(sorted((k, str(v)) for k, v in self.signature.items())),
                tuple(sorted((k, str(v)) for k, v in self.constexprs.items())), self.num_warps, self.num_stages,
                self.divisible_by_16, self.pointers_over_2gib, self.max_registers)


def _not_specialised(fn) -> set[str]:
    """The arguments ``fn`` was declared with ``do_not_specialize`` (a JIT function's or,
    under TRITON_INTERPRET, the interpreter wrapper's options)."""
    names = getattr(fn, "do_not_specialize", None) or getattr(fn, "kwargs", {}).get("do_not_specialize") or ()
    return {fn.arg_names[n] if isinstance(n, int) else n for n in names}


def specialised(launch: KernelLaunch, **ints: int) -> KernelLaunch:
    """``launch`` with its integer arguments specialised as Triton's JIT specialises them
    for these values: 1 becomes a constant, a multiple of 16 is marked divisible (the
    kernel's ``do_not_specialize`` arguments stay plain). Every integer argument of the
    signature must be given, so that none is compiled otherwise than the launch runs it."""
    given = set(ints)
    wanted = {a for a, t in launch.signature.items() if t in ("i32", "i64")}
    if given != wanted:
        raise ValueError(f"{launch.name}: integer arguments {sorted(wanted)}, values given for {sorted(given)}")
    plain = _not_specialised(launch.fn)
    ones = {a for a, v in ints.items() if v == 1 and a not in plain}
    divisible = tuple(a for a, v in ints.items() if v % 16 == 0 and a not in plain)
    return replace(launch, signature={a: "constexpr" if a in ones else t for a, t in launch.signature.items()},
                   constexprs={**launch.constexprs, **{a: 1 for a in ones}}, divisible_by_16=divisible)


def compile_for_target(
    fn,
    signature: dict[str, str],
    constexprs: dict[str, object],
    target: str,
    num_warps: int = 4,
    num_stages: int = 1,
    divisible_by_16: tuple[str, ...] = (),
) -> KernelResources:
    """Compile ``fn`` for ``target`` (a key of :data:`TARGETS`) and report its resources.

    ``signature`` maps every argument to a Triton type (``"*bf16"``, ``"i32"``,
    ``"fp32"``, ``"constexpr"``); ``constexprs`` gives the constexpr values."""
    return compile_many([CompileRequest(fn, signature, constexprs, target, num_warps, num_stages, divisible_by_16)])[0]


def compile_many(requests: Sequence[CompileRequest | AsmRequest]) -> list[KernelResources | str]:
    """Compile several specialisations: for each, in order, its resources (a CompileRequest)
    or its compiled text (an AsmRequest).

    Under TRITON_INTERPRET, ``triton.language``'s own jit functions (``tl.cdiv``,
    ``tl.sum``'s combine, ...) are interpreter wrappers and the interpreter leaves
    ``triton.language`` patched after helper calls, so nothing compiles in that process:
    the requests then go, in one batch, to fresh Python processes without the variable,
    one per core (constexpr values must be JSON values; kernels must live in importable
    modules)."""
    for r in requests:
        _check_request(_compile_request(r))
    distinct = list({_identity(r): r for r in requests}.values())  # each compiled once
    if _language_interpreted():
        done = [d if isinstance(r, AsmRequest) else KernelResources(**d)
                for r, d in zip(distinct, _compile_in_subprocess(distinct), strict=True)]
    else:
        done = [_compile_one(r) for r in distinct]
    by_identity = {_identity(r): d for r, d in zip(distinct, done, strict=True)}
    return [by_identity[_identity(r)] for r in requests]


def _identity(r: CompileRequest | AsmRequest) -> str:
    """Equal for requests that compile to the same thing (the kernel by its module and
    name, every other field by value)."""
    if isinstance(r, AsmRequest):
        return f"asm {r.kind} {_identity(r.request)}"
    fn = getattr(r.fn, "fn", r.fn)  # a JITFunction's Python function
    rest = {f.name: getattr(r, f.name) for f in fields(r) if f.name != "fn"}
    return f"{fn.__module__}.{fn.__qualname__} {rest!r}"


def _check_request(r: CompileRequest) -> None:
    """A clear error for a request no target could compile, before any compilation."""
    spec = _target_spec(r.target)
    if r.max_registers is not None and spec.gpu_target.backend != "cuda":
        raise ValueError(f"{getattr(r.fn, '__name__', r.fn)}: max_registers (maxnreg) is an NVIDIA option, "
                         f"{r.target} has none")


def _target_spec(target: str) -> TargetSpec:
    spec = TARGETS.get(target)
    if spec is None:
        raise ValueError(f"unknown target {target!r}: known targets are {sorted(TARGETS)}")
    return spec


def _language_interpreted() -> bool:
    """triton.language was set up for the interpreter (TRITON_INTERPRET at import)."""
    return not isinstance(triton.language.standard.cdiv, JITFunction)


def compiled_asm(r: CompileRequest, kind: str) -> str:
    """The compiled text of one request (see AsmRequest); batch several with compile_many."""
    return compile_many([AsmRequest(r, kind)])[0]


def _compile_request(r: CompileRequest | AsmRequest) -> CompileRequest:
    return r.request if isinstance(r, AsmRequest) else r


def _compile_one(r: CompileRequest | AsmRequest) -> KernelResources | str:
    if isinstance(r, CompileRequest):
        return _compile(r)
    compiled = _triton_compile(r.request)
    if r.kind not in compiled.asm:
        raise ValueError(f"no {r.kind!r} for {r.request.target}: have {sorted(compiled.asm)}")
    return compiled.asm[r.kind]


def _triton_compile(r: CompileRequest):
    spec = _target_spec(r.target)
    fn = r.fn
    if not isinstance(fn, JITFunction):
        raise TypeError(f"{fn!r} is not a @triton.jit function (was it decorated under TRITON_INTERPRET?)")
    missing = [a for a in fn.arg_names if a not in r.signature]
    if missing:
        raise ValueError(f"{fn.__name__}: signature lacks arguments {missing}")
    unknown = [a for a in r.pointers_over_2gib if a not in r.signature]
    if unknown:
        raise ValueError(f"{fn.__name__}: pointers_over_2gib names no argument: {unknown}")
    src = ASTSource(fn=fn, signature=r.signature, constexprs=r.constexprs, attrs=attributes(r))
    options = {"num_warps": r.num_warps, "num_stages": r.num_stages}
    if r.max_registers is not None:
        options["maxnreg"] = r.max_registers
    return triton.compile(src, target=spec.gpu_target, options=options)


def attributes(r: CompileRequest) -> dict[tuple[int, ...], list[list]]:
    """The per-argument attributes Triton's JIT derives when the launch's tensors are
    256-byte aligned (module docstring): by argument position (a tuple argument's
    elements by (position, index)), the arguments without any left out."""
    amd = _target_spec(r.target).is_amd

    def pointer(name: str) -> list[list]:
        buffer_ops = amd and name not in r.pointers_over_2gib
        return [["tt.divisibility", 16]] + ([["tt.pointer_range", 32]] if buffer_ops else [])

    attrs = {}
    for name, ty in r.signature.items():
        i = r.fn.arg_names.index(name)
        if isinstance(ty, tuple):  # a tuple of pointers (a kernel taking a list of tensors)
            attrs.update({(i, j): pointer(name) for j, t in enumerate(ty) if t.startswith("*")})
        elif ty.startswith("*"):
            attrs[(i,)] = pointer(name)
        elif name in r.divisible_by_16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def _compile(r: CompileRequest) -> KernelResources:
    spec = _target_spec(r.target)
    compiled = _triton_compile(r)
    fn = r.fn
    shared = int(compiled.metadata.shared)
    if spec.is_amd:
        registers, spills = _amdgcn_registers(compiled.asm["amdgcn"])
    else:
        registers, spills = _cubin_registers(compiled.asm["cubin"], compiled.metadata.name)
    return KernelResources(
        kernel=fn.__name__,
        target=r.target,
        num_warps=r.num_warps,
        shared_bytes=shared,
        shared_limit_bytes=spec.shared_per_program_bytes,
        registers=registers,
        spills=spills,
        occupancy=occupancy(spec, r.num_warps, shared, registers),
    )


def _amdgcn_registers(asm: str) -> tuple[int | None, int | None]:
    """(VGPRs, VGPRs spilled to scratch) from the code object metadata (YAML) in the AMDGCN text."""

    def field(name: str) -> int | None:
        match = re.search(rf"^\s*\.{name}:\s+(\d+)", asm, re.MULTILINE)
        return int(match.group(1)) if match else None

    return field("vgpr_count"), field("vgpr_spill_count")


def _cubin_registers(cubin: bytes, name: str) -> tuple[int | None, int | None]:
    """(registers per thread, spilled 32-bit words) from ``cuobjdump -res-usage``; (None,
    None) when the tool that ships with Triton is unavailable."""
    try:
        tool = triton.knobs.nvidia.cuobjdump.path
    except RuntimeError:  # "Cannot find cuobjdump"
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        try:
            out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None, None
    match = re.search(rf"Function {re.escape(name)}:\s*REG:(\d+)\s+STACK:(\d+).*?LOCAL:(\d+)", out)
    if match is None:
        return None, None
    return int(match.group(1)), (int(match.group(2)) + int(match.group(3))) // 4


def _compile_in_subprocess(requests: Sequence[CompileRequest | AsmRequest]) -> list:
    """Compile in fresh processes without TRITON_INTERPRET: each request's resources (as a
    dict) or compiled text."""
    jobs = []
    for item in requests:
        r = _compile_request(item)
        inner = getattr(r.fn, "fn", None)  # the Python function under a JIT or interpreter wrapper
        if inner is None or inner.__module__ == "__main__":
            raise ValueError(f"{r.fn!r}: AOT compilation under TRITON_INTERPRET needs a @triton.jit function "
                             "defined at the top level of an importable module")
        jobs.append({"module": inner.__module__, "name": inner.__name__, "signature": r.signature,
                     "constexprs": r.constexprs, "target": r.target, "num_warps": r.num_warps,
                     "num_stages": r.num_stages, "divisible_by_16": list(r.divisible_by_16),
                     "pointers_over_2gib": list(r.pointers_over_2gib), "max_registers": r.max_registers,
                     "asm": item.kind if isinstance(item, AsmRequest) else None})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same modules, tests included

    def compile_part(part: list[dict]) -> list:
        proc = subprocess.run(
            [sys.executable, "-c", f"from {__name__} import _subprocess_main; _subprocess_main()"],
            input=json.dumps(part), capture_output=True, text=True, env=env, check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"AOT compilation in a subprocess failed:\n{proc.stderr[-6000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    # One process per core, each with every n-th job: compiling is single-threaded.
    n = min(len(jobs), len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(n) as pool:
        parts = list(pool.map(compile_part, [jobs[i::n] for i in range(n)]))
    results: list = [None] * len(jobs)
    for i, part in enumerate(parts):
        results[i::n] = part
    return results


def _subprocess_main() -> None:
    """Compile the JSON job list on stdin; print the resources (or asm texts) as one JSON line."""
    # A kernel module (a test) may set TRITON_INTERPRET when imported: keep compiling.
    triton.knobs.runtime.interpret = False
    results = []
    for job in json.load(sys.stdin):
        fn = getattr(importlib.import_module(job.pop("module")), job.pop("name"))
        job["divisible_by_16"] = tuple(job["divisible_by_16"])
        job["pointers_over_2gib"] = tuple(job["pointers_over_2gib"])
        job["signature"] = {k: tuple(v) if isinstance(v, list) else v for k, v in job["signature"].items()}
        kind = job.pop("asm")
        request = CompileRequest(fn, **job)
        results.append(_compile_one(AsmRequest(request, kind)) if kind else asdict(_compile(request)))
    print(json.dumps(results))
