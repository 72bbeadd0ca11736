"""Kernel names and classes of the GPU-busy profile (the profile itself runs in tests/cuda)."""

import pytest

from packgraph.bench.profiling import kernel_class, short_kernel_name


@pytest.mark.parametrize(
    "name, cls",
    [
        ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>", "attention bwd"),
        ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention fwd"),
        ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        (
            "void at::native::multi_tensor_apply_kernel<TensorListMetadata<2>, BinaryOpListAlphaFunctor>",
            "foreach (grad buffers)",
        ),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "inductor (triton)"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>", "reduction"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "elementwise"),
        ("Memset (Device)", "memcpy/memset"),
        ("Memcpy HtoD (Pageable -> Device)", "memcpy/memset"),
        ("some_custom_kernel", "other"),
    ],
)
def test_kernel_classes(name, cls):
    assert kernel_class(name) == cls


def test_short_kernel_names_keep_the_functor():
    ns = "at::native::(anonymous namespace)::"
    name = f"void {ns}multi_tensor_apply_kernel<{ns}ZeroFunctor>"
    assert short_kernel_name(name) == "multi_tensor_apply_kernel<ZeroFunctor>"
    assert len(short_kernel_name("x" * 500)) == 160
