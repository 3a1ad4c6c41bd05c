"""Compile every Triton kernel variant for a GPU architecture, without a GPU.

The CPU interpreter checks what kernels compute but not that they lower to
PTX/cubin; this does (Triton's bundled ptxas, no driver needed). Run it in a
process where TRITON_INTERPRET is unset:

    python tests/kernels/aot_compile.py [--arch 90] [--aligned] [--only NAME] [--dump DIR]

Prints one line per variant and exits non-zero if any fails. ``--aligned``
compiles what the JIT compiles for 16-byte aligned pointers and integer
arguments divisible by 16 (the usual launch: vectorized loads, software
pipelining); ``--dump`` writes each variant's TTGIR and cubin to read offline
(``nvdisasm -c`` from Triton's ``backends/nvidia/bin``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import freescale.kernels.attention.triton_cross as cross
import freescale.kernels.attention.triton_hstu_bwd as hstu_bwd
import freescale.kernels.attention.triton_hstu_fwd as hstu_fwd
import freescale.kernels.triton_bucketize as bucketize
import freescale.kernels.triton_collision as collision
import freescale.kernels.triton_common as common
import freescale.kernels.triton_dispatch as dispatch
import freescale.kernels.triton_permute as permute
import freescale.kernels.triton_rows as rows
import freescale.kernels.triton_small_table as small_table
import freescale.kernels.triton_update as update

Variant = tuple[str, object, dict, dict[str, object]]


def signature(kernel, ptrs: dict, ints: str, consts: dict[str, object]) -> dict:
    """Types of every parameter: pointers (or tuples of them) from ``ptrs``, other
    runtime args ``ints``."""
    sig = {}
    for p in kernel.params:
        sig[p.name] = "constexpr" if p.is_constexpr else ptrs.get(p.name, ints)
    missing = [n for n, t in sig.items() if t == "constexpr" and n not in consts]
    if missing:
        raise ValueError(f"{kernel.fn.__name__}: no value for constexprs {missing}")
    return sig


def variants(quick: bool = False) -> Iterator[Variant]:
    """Every constexpr branch the launchers use (``quick``: one of each kernel body)."""
    i64 = "*i64"
    shapes = (
        ((1, "*i64"), (64, "*i64"))
        if quick
        else ((1, "*i64"), (64, "*i64"), (1, "*i16"), (3, "*i32"))
    )
    for kernel, (words, wtype), feats, mode in itertools.product(
        (permute._permute_rows_kernel, permute._permute_segments_kernel),
        shapes,
        (3,) if quick else (1, 3),
        (permute.MODE_INDEXED, permute.MODE_TRANSPOSE),
    ):
        block_r, block_w = common.tile(words)
        ptrs = {"src_offsets": i64, "dst_offsets": i64, "indices": i64}
        ptrs |= {"srcs": (wtype,) * feats, "dsts": (wtype,) * feats}
        consts = {"MODE": mode, "BLOCK_R": block_r, "BLOCK_W": block_w}
        yield f"permute W={words} {wtype} feats={feats} mode={mode}", kernel, ptrs, consts
    for words, gather in itertools.product((64,) if quick else (1, 16, 64), (True, False)):
        block_r, block_w = common.tile(words)
        ptrs = {"src": i64, "dst": i64, "index": i64}
        consts = {"GATHER": gather, "BLOCK_R": block_r, "BLOCK_W": block_w}
        yield f"rows W={words} gather={gather}", rows._move_rows_kernel, ptrs, consts
    for mode, world in itertools.product((0, 1, 2), (512,) if quick else (8, 512, 16384)):
        block = dispatch.block_size(world)
        sub = max(1, min(block, dispatch.TILE // block))
        src = "*i32" if mode == 0 else i64
        consts = {"HAVE_DEST32": mode != 0, "BLOCK": block, "SUB": sub}
        ptrs = {"src": src, "dest32": "*i32", "hist": "*i32"}
        yield f"dispatch.count mode={mode} BLOCK={block}", dispatch._count_kernel, ptrs, consts
        if mode:
            ptrs = {"src": src, "dest32": "*i32"}
            consts = {"MODE": mode, "BLOCK": dispatch.OWNER_BLOCK}
            yield f"dispatch.owners mode={mode}", dispatch._owners_kernel, ptrs, consts
        place = {"BLOCK": block, "SUB": sub}
        for local_mode, (words, wtype) in ((mode, (1, i64)), (0, (64, i64)), (0, (3, "*i16"))):
            ptrs = {"dest32": "*i32", "cum": "*i32", "hist": "*i32", "positions": i64,
                    "values": wtype, "send": wtype, "offsets": i64, "counts": i64}  # fmt: skip
            c = place | {"LOCAL_MODE": local_mode, "BLOCK_W": dispatch.next_pow2(words)}
            yield (
                f"dispatch.place LOCAL_MODE={local_mode} BLOCK={block} words={words}",
                dispatch._place_kernel,
                ptrs,
                c,
            )
    for dtype, hashed in itertools.product(("*i32", i64), (True, False)):
        ptrs = {"ids": dtype, "owner": i64, "local": dtype}
        consts = {"HASHED": hashed, "BLOCK": bucketize.BLOCK}
        yield f"bucketize {dtype} hashed={hashed}", bucketize._bucketize_kernel, ptrs, consts
    # Sorted slots are int32 keys unless a table has more rows than int32 holds.
    for gtype, ktype in itertools.product(("*fp32", "*bf16"), ("*i32", i64)):
        ptrs = {"order": i64, "sorted_slots": ktype, "grads": gtype, "partial": "*fp32"}
        consts = {"CHUNK": update.CHUNK, "BLOCK_D": 256}
        yield f"update.piece_sums {gtype} {ktype}", update._piece_sums_kernel, ptrs, consts
    for (kind, code), wtype, per_row, decay, skip in itertools.product(
        update.KINDS.items(), ("*fp32", "*bf16"), (False, True),
        (0, *update.DECAY_MODES.values()), (False, True),
    ):  # fmt: skip
        if quick and skip and (per_row or decay):
            continue
        ptrs = {"sorted_slots": "*i32", "frozen": i64, "skip": "*u8", "partial": "*fp32",
                "weight": wtype, "state1": "*fp32", "state2": "*fp32", "lr_tables": "*fp32",
                "b1_tables": "*fp32", "b2_tables": "*fp32", "table_bounds": i64, "lr": "fp32",
                "bc1": "fp32", "bc2": "fp32", "eps": "fp32", "beta1": "fp32", "beta2": "fp32",
                "weight_decay": "fp32", "D_f": "fp32"}  # fmt: skip
        consts = {
            "KIND": code,
            "DECAY": decay,
            "PER_ROW": per_row,
            "SKIP": skip,
            "CHUNK": update.CHUNK,
            "BLOCK_D": 256,
            "FAN": 16,
        }
        name = f"update.apply {kind} {wtype} per_row={per_row} decay={decay} skip={skip}"
        yield name, update._apply_kernel, ptrs, consts
        if (kind, wtype, per_row, decay, skip) == ("sgd", "*fp32", False, 0, False):
            # Tables of more rows than int32 holds keep int64 sort keys.
            yield name + " i64 keys", update._apply_kernel, ptrs | {"sorted_slots": i64}, consts
    for (rows_, ids), gtype in itertools.product(
        ((1, None), (4, i64), (4, "*i32"), (32, i64)), ("*fp32", "*bf16")
    ):
        block_d = 128
        consts = {"ROWS": rows_, "BLOCK_T": max(1, small_table.TILE // (rows_ * block_d)),
                  "BLOCK_D": block_d, "HAS_IDS": ids is not None}  # fmt: skip
        ptrs = {"ids": ids or gtype, "grad": gtype, "partial": "*fp32"}
        name = f"small_table.partials rows={rows_} ids={ids} {gtype}"
        yield name, small_table._partials_kernel, ptrs, consts
        consts = {"ROWS": rows_, "BLOCK_P": small_table.PARTIALS, "BLOCK_D": 32}
        ptrs = {"partial": "*fp32", "out": gtype}
        yield f"small_table.totals rows={rows_} {gtype}", small_table._totals_kernel, ptrs, consts
    yield from cross_attention_variants(quick)
    for dtype in ("*i32", i64):
        ptrs = {"now": dtype, "nxt": dtype, "now_to_next": i64, "next_to_now": i64}
        consts = {"BLOCK": collision.BLOCK}
        yield f"collision {dtype}", collision._collision_kernel, ptrs, consts
    yield from hstu_variants(quick)
    slots = {"now": i64, "nxt": i64, "sorted_now": i64, "sorted_next": i64, "stats": i64}
    ptrs = {**slots, "now_mark": "*u8", "next_mark": "*u8"}
    yield "collision.marks", collision._marks_kernel, ptrs, {"BLOCK": collision.BLOCK}


def hstu_variants(quick: bool) -> Iterator[Variant]:
    """The fused HSTU attention's kernels: each head dim the model uses, bias or not,
    with and without history outputs, at each kernel's first and last config."""
    from freescale.kernels.attention.hstu import CONFIGS

    i64 = "*i64"
    kernels = {
        "fwd": hstu_fwd._fwd_kernel,
        "dq": hstu_bwd._dq_kernel,
        "dkdv": hstu_bwd._dkdv_kernel,
    }
    for (kind, kernel), dtype, head_dim, bias, uih_out in itertools.product(
        kernels.items(), ("*bf16", "*fp32"), (32, 64, 128), (True, False), (True, False)
    ):
        if quick and (dtype == "*fp32" or head_dim != 64 or not uih_out):
            continue
        ints = ("DH", "H")
        ptrs = {p.name: dtype for p in kernel.params
                if p.name[0].isupper() and not p.is_constexpr and p.name not in ints}  # fmt: skip
        ptrs |= {n: i64 for n in ("T_u", "T_c", "UIH_OFF", "CAND_OFF", "ORDER")}
        ptrs |= {"BLOCK_START": "*i32", "POS": "*fp32", "TIME": "*fp32", "alpha": "fp32"}
        ptrs |= {"PTHR": "*i32", "TTHR": "*i64"}  # bucket starts (`hstu._starts`)
        ptrs |= {"DPOS": "*fp32", "DTIME": "*fp32"}
        for bm, bn, _, _ in (CONFIGS[kind][0], CONFIGS[kind][-1]):
            consts = {"D": head_dim, "BM": bm, "BN": bn, "UIH_OUT": uih_out, "HAS_BIAS": bias,
                      "FAST": True, "PREC": "ieee" if dtype == "*fp32" else "tf32"}  # fmt: skip
            name = f"hstu.{kind} {dtype} d={head_dim} bias={bias} uih_out={uih_out} {bm}x{bn}"
            yield name, kernel, ptrs, consts


def cross_attention_variants(quick: bool) -> Iterator[Variant]:
    """The cross-attention's kernels per input dtype and head dim."""
    f32, i64 = "*fp32", "*i64"
    plan = {"q_offsets": i64, "k_offsets": i64, "chunk_offsets": "*i32", "span": "*i32",
            "part_offsets": i64}  # fmt: skip
    dtypes, dims = (("*bf16",), (64,)) if quick else (("*bf16", "*fp16", f32), cross.HEAD_DIMS)
    for dt, dim in itertools.product(dtypes, dims):
        precision = "ieee" if dt == f32 else "tf32"
        tiles = {"H": 4, "D": dim, "BLOCK_M": cross.BLOCK_M, "BLOCK_N": 64, "PRECISION": precision}
        ptrs = plan | {"q": dt, "k": dt, "v": dt, "part_o": f32, "part_lse": f32}
        ptrs["qk_scale"] = "fp32"
        yield f"cross.fwd_split {dt} D={dim}", cross._cross_attn_fwd_split, ptrs, tiles
        ptrs = ptrs | {"do": dt, "lse": f32, "delta": f32, "dk": dt, "dv": dt, "part_dq": f32,
                       "sm_scale": "fp32"}  # fmt: skip
        yield (
            f"cross.bwd_split {dt} D={dim}",
            cross._cross_attn_bwd_split,
            ptrs,
            tiles | {"MIN_CHUNK": 256},
        )
        for softmax in (True, False):
            ptrs = plan | {"part_o": f32, "part_lse": f32, "out": dt, "lse": f32 if softmax else dt}
            consts = {"H": 4, "D": dim, "SOFTMAX": softmax}
            yield (
                f"cross.reduce {dt} D={dim} softmax={softmax}",
                cross._cross_attn_reduce,
                ptrs,
                consts,
            )


def aligned(kernel, sig: dict) -> dict:
    """The JIT's specialization of an aligned launch: every pointer and integer
    argument divisible by 16 (those the kernel keeps unspecialized excepted)."""
    attrs = {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr or p.do_not_specialize or sig[p.name].startswith("fp"):
            continue
        attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90")
    parser.add_argument("--ints", default="i32,i64", help="integer widths of runtime scalars")
    parser.add_argument("--quick", action="store_true", help="one variant per kernel body")
    parser.add_argument(
        "--aligned", action="store_true", help="as the JIT specializes an aligned launch"
    )
    parser.add_argument("--only", default="", help="variants whose name starts with this")
    parser.add_argument("--dump", type=Path, help="write each variant's TTGIR and cubin here")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    cases = itertools.product(variants(args.quick), args.ints.split(","))
    for (name, kernel, ptrs, consts), ints in cases:
        if not name.startswith(args.only):
            continue
        start = time.perf_counter()
        try:
            sig = signature(kernel, ptrs, ints, consts)
            attrs = aligned(kernel, sig) if args.aligned else None
            src = ASTSource(kernel, sig, constexprs=consts, attrs=attrs)
            compiled = triton.compile(src, target=target)
            status = f"ok ({len(compiled.asm['cubin'])} B cubin)"
            if args.dump:
                stem = args.dump / re.sub(r"[^\w.=-]+", "_", f"{name} {ints}")
                args.dump.mkdir(parents=True, exist_ok=True)
                Path(f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
                Path(f"{stem}.cubin").write_bytes(compiled.asm["cubin"])
        except Exception as exc:  # report every failing variant, not just the first
            failures += 1
            status = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        print(f"sm_{args.arch} {name} ints={ints}: {status} {time.perf_counter() - start:.1f}s")
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
