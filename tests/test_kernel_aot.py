"""AOT compilation reports (runtime/kernels/aot.py) for targets this machine lacks.

TRITON_INTERPRET is set before Triton is imported, as in every test file that imports
Triton (see tests/test_kernel_mla_decode.py): then aot compiles in a subprocess, which
these tests exercise; on a GPU machine it compiles in-process.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from k3compile.runtime.kernels import aot  # noqa: E402


@triton.jit
def _add_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """One tile C = A @ B: both operands are staged through shared memory (LDS)."""
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


ADD = ({"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024})
MATMUL_SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "M": "constexpr", "N": "constexpr",
              "K": "constexpr"}
SMALL = {"M": 64, "N": 64, "K": 64}  # 8 KiB per operand
BIG = {"M": 64, "N": 128, "K": 512}  # B is 128 KiB: more than an MI300X CU's LDS, less than an MI355X's


def aot_requests() -> dict[tuple[str, str], aot.CompileRequest]:
    """Every compilation of this file (the session compiles them in one batch: conftest's aot_reports)."""
    return {
        ("add", t): aot.CompileRequest(_add_kernel, *ADD, t) for t in ("gfx950", "gfx942", "sm_90")
    } | {
        ("small", t): aot.CompileRequest(_matmul_kernel, MATMUL_SIG, SMALL, t) for t in ("gfx950", "gfx942", "sm_90")
    } | {
        ("big", t): aot.CompileRequest(_matmul_kernel, MATMUL_SIG, BIG, t) for t in ("gfx950", "gfx942")
    } | {
        ("capped", "sm_90"): aot.CompileRequest(_matmul_kernel, MATMUL_SIG, SMALL, "sm_90", max_registers=64),
    }


def test_elementwise_kernel_needs_no_lds_and_reaches_full_occupancy(aot_reports):
    for target in ("gfx950", "gfx942"):
        res = aot_reports["add", target]
        assert res.kernel == "_add_kernel" and res.target == target and res.num_warps == 4
        assert res.shared_bytes == 0 and res.spills == 0 and 0 < res.registers <= 32
        assert res.occupancy == 8 and res.fits  # 8 waves per SIMD: the CDNA maximum


def test_matmul_tile_reports_lds_and_fits(aot_reports):
    for target in ("gfx950", "gfx942"):
        res = aot_reports["small", target]
        assert 0 < res.shared_bytes <= 2 * 64 * 64 * 2  # at most both bf16 operands
        assert res.shared_limit_bytes == aot.TARGETS[target].shared_per_program_bytes
        assert res.registers > 0 and res.spills == 0 and res.fits
    assert aot_reports["small", "gfx950"].shared_limit_bytes == 160 * 1024
    assert aot_reports["small", "gfx942"].shared_limit_bytes == 64 * 1024


def test_lds_beyond_mi300x_fits_only_mi355x(aot_reports):
    big950, big942 = aot_reports["big", "gfx950"], aot_reports["big", "gfx942"]
    assert 64 * 1024 < big942.shared_bytes <= 160 * 1024
    assert big950.fits and not big942.fits


def test_nvidia_registers_from_the_cubin(aot_reports):
    res = aot_reports["small", "sm_90"]
    assert res.shared_limit_bytes == 227 * 1024 and 0 < res.shared_bytes
    assert res.registers is not None and 0 < res.registers <= 255 and res.spills == 0
    assert res.occupancy % 4 == 0 and res.occupancy > 0 and res.fits  # whole CTAs of 4 warps


def test_register_cap_is_passed_to_nvidia_and_refused_for_amd(aot_reports):
    capped, free = aot_reports["capped", "sm_90"], aot_reports["small", "sm_90"]
    assert capped.registers <= 64 < free.registers, (capped, free)
    with pytest.raises(ValueError, match="maxnreg.*NVIDIA option"):
        aot.compile_many([aot.CompileRequest(_matmul_kernel, MATMUL_SIG, SMALL, "gfx950", max_registers=64)])


def test_equal_requests_compile_once():
    """Requests built separately but equal share one compile (one result object); a
    request that differs in any field (here the warps) gets its own."""
    make = lambda warps: aot.CompileRequest(_add_kernel, dict(ADD[0]), dict(ADD[1]), "gfx942", warps)  # noqa: E731
    a, b, c = aot.compile_many([make(4), make(4), make(8)])
    assert a is b and c is not a and a.fits and c.fits


#: torch dtypes of the pointer element types the launches use
_ELEMENT_DTYPES = {**{name: dtype for dtype, name in aot.TRITON_DTYPES.items()},
                   "i32": torch.int32, "i64": torch.int64, "u8": torch.uint8, "i8": torch.int8}


def jit_specialisation(launch: aot.KernelLaunch, target: str) -> tuple[dict, dict]:
    """(signature, attributes) that Triton's JIT derives for ``launch`` on ``target`` from
    arguments of the sizes the launch declares (its own binder and argument packing, which
    run without a GPU): aligned tensors, of 3 GiB (meta) for ``pointers_over_2gib`` and of
    a few KiB otherwise (a tuple of them for a list argument); integers multiples of 16
    where ``divisible_by_16`` says so, else 17; the constants a launch declares (among them
    integers equal to 1, which the JIT makes constants: ``aot.specialised``) as they are."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if isinstance(launch.fn, JITFunction):
        fn = launch.fn
    else:  # under TRITON_INTERPRET an interpreter wrapper: the same function and jit options
        fn = JITFunction(launch.fn.fn, **launch.fn.kwargs)
    backend = make_backend(aot.TARGETS[target].gpu_target)
    args = []
    for name in fn.arg_names:
        ty = launch.signature[name]
        if ty == "constexpr":
            args.append(launch.constexprs[name])
        elif isinstance(ty, tuple):
            args.append(tuple(torch.empty(1024, dtype=_ELEMENT_DTYPES[t[1:]]) for t in ty))
        elif ty.startswith("*"):
            dtype = _ELEMENT_DTYPES[ty[1:]]
            big = name in launch.pointers_over_2gib
            args.append(torch.empty(3 * 2**30 // dtype.itemsize if big else 1024, dtype=dtype,
                                    device="meta" if big else "cpu"))
        elif ty.startswith("fp"):
            args.append(0.5)
        else:
            args.append(32 if name in launch.divisible_by_16 else 17)
    bound, specialisation, options = create_function_from_signature(fn.signature, fn.params, backend)(*args)
    _, signature, _, attrs = fn._pack_args(backend, {}, bound, specialisation, options)
    return signature, {k: v for k, v in attrs.items() if v}


def test_attributes_are_what_the_jit_derives():
    """aot.attributes, with which every kernel is compiled for its reports, against the JIT's
    own specialisation of the same launch (jit_specialisation, with the kernel's
    ``do_not_specialize``): equal for every launch of the MLA kernels (cache pools over 2
    GiB) and of the KDA prefill, on gfx950 (buffer loads for every pointer but the pools)
    and on sm_90 (alignment only). This checks the attribute rules against Triton's, for
    the sizes each launch declares; whether the runtime's tensors have those sizes is the
    declarations' claim (decision 62)."""
    from k3compile.runtime.kernels import kda_prefill, mla_cache_write, mla_decode

    checked = 0
    for target in ("gfx950", "sm_90"):
        launches = [*mla_decode.aot_launches(target), mla_cache_write.aot_launch(torch.float8_e4m3fn),
                    *kda_prefill.aot_requests(target)]
        for launch in launches:
            if any(str(ty).startswith("tensordesc") for ty in launch.signature.values()):
                continue  # TMA descriptors (sm_90 split-KV): not tensors
            request = launch.request(target)
            signature, attrs = jit_specialisation(launch, target)
            assert signature == {k: v for k, v in launch.signature.items() if v != "constexpr"} | {
                k: "constexpr" for k in launch.constexprs}, launch.name
            assert aot.attributes(request) == attrs, (launch.name, target)
            checked += 1
    assert checked >= 20
    pools = aot.attributes(mla_decode.aot_launches("gfx950")[0].request("gfx950"))
    assert pools[(1,)] == [["tt.divisibility", 16]] and ["tt.pointer_range", 32] in pools[(0,)]


def test_launch_report_launches_are_what_the_jit_derives():
    """The same check for every launch the kernel launch report plans for a K3 TP8 rank
    (runtime/kernels/launch_report.py): decode at batch 1 and 16, prefill of 128K tokens
    (whose largest tensors take the 64-bit variants), on gfx950 and sm_90."""
    from k3compile.config import PRESETS
    from k3compile.runtime.kernels.launch_report import StepShapes, planned_launches

    checked, wide = 0, 0
    for target in ("gfx950", "sm_90"):
        for batch in (1, 16):
            shapes = StepShapes.of_model(PRESETS["k3"], 8, 1, batch, 131072, torch.bfloat16)
            for planned in planned_launches(target, shapes):
                launch = planned.launch
                if any(str(ty).startswith("tensordesc") for ty in launch.signature.values()):
                    continue
                _, attrs = jit_specialisation(launch, target)
                assert aot.attributes(launch.request(target)) == attrs, (planned.name, target)
                checked += 1
                wide += target == "gfx950" and bool(launch.pointers_over_2gib)
    assert checked >= 30 and wide >= 5  # the 64-bit variants among them


def test_unknown_target_is_a_clear_error():
    known = r"known targets are \['gfx942', 'gfx950', 'sm_90'\]"
    with pytest.raises(ValueError, match=rf"unknown target 'gfx1200': {known}"):
        aot.compile_for_target(_add_kernel, *ADD, "gfx1200")


def test_occupancy_formulas():
    mi300, h200 = aot.TARGETS["gfx942"], aot.TARGETS["sm_90"]
    assert aot.occupancy(mi300, 4, 0, 128) == 4  # 512 VGPRs / 128
    assert aot.occupancy(mi300, 4, 0, 129) == 3  # allocated in granules of 8: 136
    assert aot.occupancy(mi300, 4, 40 * 1024, 64) == 1  # one 40 KiB workgroup per 64 KiB CU
    assert aot.occupancy(mi300, 8, 16 * 1024, 64) == 8  # 4 workgroups x 8 waves / 4 SIMDs
    assert aot.occupancy(mi300, 4, 0, None) is None
    # H200: 255 regs -> 8192 per warp -> 8 warps -> 2 CTAs of 4 warps
    assert aot.occupancy(h200, 4, 59392, 255) == 8
    assert aot.occupancy(h200, 4, 100 * 1024, 32) == 8  # shared memory: 2 CTAs per SM
    assert aot.occupancy(h200, 4, 0, 32) == 64  # the 64-warp limit


def test_target_facts():
    assert aot.TARGETS["gfx950"].compute_units == 256 and aot.TARGETS["gfx950"].shared_per_unit_bytes == 160 * 1024
    assert aot.TARGETS["gfx942"].compute_units == 304 and aot.TARGETS["gfx942"].shared_per_unit_bytes == 64 * 1024
    assert aot.TARGETS["sm_90"].compute_units == 132 and aot.TARGETS["sm_90"].shared_per_unit_bytes == 228 * 1024
