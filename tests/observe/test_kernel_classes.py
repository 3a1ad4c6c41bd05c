"""Kernel classes by name (`observe/kernel_classes.py`): the names an
H200 trace shows, Inductor's and ours; per-step sums over a small trace."""

from __future__ import annotations

import pytest

from freescale.observe.kernel_classes import CLASSES, kernel_class, kernel_times

NAMES = {
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0":
        "self_attn_fwd",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_5_64x128x64_4x1x1_kernel0_0":
        "self_attn_bwd",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, false, false, "
    "cutlass::bfloat16_t>, false, true, false, false, true, true, false, false>(Flash_fwd_params)":
        "cross_attn",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, "
    "128, 128, 8, 4, 2, 4, false, false, cutlass::bfloat16_t>>(Flash_bwd_params)": "cross_attn",
    "_cross_attention_fwd_kernel": "cross_attn",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float>(...)": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>"
    "(int, float, float const*, float const*, float const*, float*, float*, float*)": "layer_norm",
    "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel_32x32<float, float>(...)":
        "layer_norm",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<at::native::(anonymous "
    "namespace)::OpaqueType<2u>, unsigned int, 2, 128, 1>(...)": "concat",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t"
    "<float, at::native::sum_functor<float, float, float>::operator()>, unsigned int, float, 4>>"
    "(...)": "reduction",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul>>(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, "
    "3ul>)": "elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>(...)":
        "elementwise",
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<...>>(int, ...)":
        "elementwise",
    "triton_per_fused_add_native_layer_norm_0": "inductor",
    "triton_red_fused_native_layer_norm_backward_3": "inductor",
    "triton_poi_fused__to_copy_gelu_1": "inductor",
    "_small_table_grad_kernel": "triton",
    "_permute_rows_kernel": "triton",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "other",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, "
    "2, -2, true>(...)": "other",
}  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_each_kernel_lands_in_its_class(name):
    assert kernel_class(name) == NAMES[name]
    assert kernel_class(name) in CLASSES


def _x(name, dur, cat="kernel", ts=0.0, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_times_are_per_traced_step_and_memory_bound_sums_its_classes():
    at = iter(range(0, 100_000, 10_000))  # one after another: no overlap
    trace = {"traceEvents": [
        _x("ProfilerStep#30", 9e3, cat="user_annotation"),
        _x("ProfilerStep#31", 9e3, cat="user_annotation"),
        _x("ProfilerStep#31", 9e3, cat="gpu_user_annotation"),  # the GPU mirror: not a step
        _x("nvjet_tst_128x256", 4000.0, ts=next(at)), _x("nvjet_tst_64x8", 2000.0, ts=next(at)),
        _x("triton_poi_fused_add_0", 600.0, ts=next(at)),
        _x("void at::native::reduce_kernel<512, 1>(...)", 200.0, ts=next(at)),
        _x("Memcpy HtoD (Pinned -> Device)", 100.0, cat="gpu_memcpy", ts=next(at)),
        _x("aten::mm", 5000.0, cat="cpu_op"),  # host op: not GPU time
    ]}  # fmt: skip
    t = kernel_times(trace)
    assert t["gemm"].ms == 3.0 and t["gemm"].launches == 1.0  # 6 ms over 2 steps
    assert t["inductor"].ms == 0.3 and t["reduction"].ms == 0.1
    assert t["other"].ms == 0.05 and t["triton"].ms == 0.0
    assert t["memory_bound"].ms == pytest.approx(0.4) and t["memory_bound"].launches == 1.0
    assert t["busy"].ms == pytest.approx(3.45) == t["busy"].stream_ms
    with pytest.raises(ValueError, match="no traceEvents"):
        kernel_times({})


def test_our_cross_attention_kernels_count_as_cross_attention():
    """Every Triton kernel of the cross-attention module (read from its source:
    Triton need not import here) lands in ``cross_attn``, not ``triton`` or
    ``reduction`` (a kernel once named ``_reduce_kernel`` did)."""
    import ast
    from pathlib import Path

    import freescale.kernels.attention as pkg

    source = Path(pkg.__file__).with_name("triton_cross.py").read_text()
    kernels = [
        f.name
        for f in ast.parse(source).body
        if isinstance(f, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in f.decorator_list)
    ]
    launched = [k for k in kernels if f"{k}[" in source]  # helpers are inlined
    assert len(launched) >= 3, launched
    assert {k: kernel_class(k) for k in launched} == {k: "cross_attn" for k in launched}


def test_overlapping_streams_share_their_time_and_classes_add_up_to_the_union():
    """Two streams: a GEMM [0, 10) ms beside an Inductor kernel [4, 8) and a copy
    [9, 12): the 12 ms of busy time, not the 17 of summed durations."""
    trace = {"traceEvents": [
        _x("nvjet_tst_128x256", 10e3, ts=0.0, stream=7),
        _x("triton_poi_fused_add_0", 4e3, ts=4e3, stream=9),
        _x("Memcpy DtoH", 3e3, cat="gpu_memcpy", ts=9e3, stream=9),
    ]}  # fmt: skip
    t = kernel_times(trace)
    assert t["gemm"].ms == pytest.approx(4 + 2 + 1 + 0.5) and t["gemm"].stream_ms == 10.0
    assert t["inductor"].ms == pytest.approx(2.0) and t["other"].ms == pytest.approx(2.5)
    assert t["busy"].ms == pytest.approx(12.0) and t["busy"].stream_ms == pytest.approx(17.0)


def test_shares_sum_to_the_trace_modules_union_on_random_spans():
    import random

    from freescale.observe.kernel_classes import share_busy_time
    from freescale.observe.trace import _length, _union

    rng = random.Random(0)
    for _ in range(50):
        spans = [(s := rng.uniform(0, 100), s + rng.choice([0.0, rng.uniform(0, 30)]),
                  rng.choice(CLASSES)) for _ in range(rng.randint(0, 40))]  # fmt: skip
        union = _length(_union([(a, b) for a, b, _ in spans if b > a]))
        assert sum(share_busy_time(spans).values()) == pytest.approx(union, abs=1e-9)
