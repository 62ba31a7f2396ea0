// Instantiations of the grouped MoE GEMM: DOWN, fp8 weights (one file per
// family so the variants compile in parallel).
#include "kernels/moe/moe_grouped_gemm.cuh"

namespace nucleus::kernels::moe_grouped {
template cudaError_t launch_grouped_gemm_impl<16, 64, true, false, false>(const GemmArgs&, int64_t, cudaStream_t);
template cudaError_t launch_grouped_gemm_impl<32, 64, true, false, false>(const GemmArgs&, int64_t, cudaStream_t);
template cudaError_t launch_grouped_gemm_impl<64, 128, true, false, false>(const GemmArgs&, int64_t, cudaStream_t);
template cudaError_t launch_grouped_gemm_impl<128, 128, true, false, false>(const GemmArgs&, int64_t, cudaStream_t);
template cudaError_t launch_grouped_gemm_impl<16, 64, true, false, true>(const GemmArgs&, int64_t, cudaStream_t);
template cudaError_t launch_grouped_gemm_impl<32, 64, true, false, true>(const GemmArgs&, int64_t, cudaStream_t);
}  // namespace nucleus::kernels::moe_grouped
