"""Kernel classes by name (`observe/kernel_classes.py`): the names issue 42's
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


def _x(name, dur, cat="kernel", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": 0.0, "dur": dur, "args": args}


def test_times_are_per_traced_step_and_memory_bound_sums_its_classes():
    trace = {"traceEvents": [
        _x("ProfilerStep#30", 9e3, cat="user_annotation"),
        _x("ProfilerStep#31", 9e3, cat="user_annotation"),
        _x("ProfilerStep#31", 9e3, cat="gpu_user_annotation"),  # the GPU mirror: not a step
        _x("nvjet_tst_128x256", 4000.0), _x("nvjet_tst_64x8", 2000.0),
        _x("triton_poi_fused_add_0", 600.0),
        _x("void at::native::reduce_kernel<512, 1>(...)", 200.0),
        _x("Memcpy HtoD (Pinned -> Device)", 100.0, cat="gpu_memcpy"),
        _x("aten::mm", 5000.0, cat="cpu_op"),  # host op: not GPU time
    ]}  # fmt: skip
    t = kernel_times(trace)
    assert t["gemm"].ms == 3.0 and t["gemm"].launches == 1.0  # 6 ms over 2 steps
    assert t["inductor"].ms == 0.3 and t["reduction"].ms == 0.1
    assert t["other"].ms == 0.05 and t["triton"].ms == 0.0
    assert t["memory_bound"].ms == pytest.approx(0.4) and t["memory_bound"].launches == 1.0
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
