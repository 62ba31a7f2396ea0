// Instantiations of the grouped MoE GEMM: UP, bf16 weights (one file per
// family so the variants compile in parallel).
#include "kernels/moe/moe_grouped_gemm.cuh"

namespace nucleus::kernels::moe_grouped {
template cudaError_t launch_grouped_gemm_impl<16, 128, false, true, false>(const GemmArgs&, int64_t, cudaStream_t);
template cudaError_t launch_grouped_gemm_impl<32, 128, false, true, false>(const GemmArgs&, int64_t, cudaStream_t);
template cudaError_t launch_grouped_gemm_impl<64, 128, false, true, false>(const GemmArgs&, int64_t, cudaStream_t);
template cudaError_t launch_grouped_gemm_impl<128, 128, false, true, false>(const GemmArgs&, int64_t, cudaStream_t);
}  // namespace nucleus::kernels::moe_grouped
