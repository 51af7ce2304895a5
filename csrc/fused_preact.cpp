// Operator schemas of the CUDA C++ backend, registered into the `fused_preact` namespace next to the
// Python custom ops (fused_preact::bn_relu_conv2d, ...); every name here carries the `cuda_` prefix.
// The CUDA kernels are registered in ops.cu (TORCH_LIBRARY_IMPL(fused_preact, CUDA, ...)).
// This file is plain C++ and compiles against a CPU-only torch.
#include "launchers.h"

#include <torch/library.h>

#include <string>

namespace fused_preact {
namespace {

// "archs=800,900;cutlass=4.2.0;dtypes=float16,bfloat16;sm90a=1": what this build of the extension
// serves (sm90a: the CUTLASS 3.x kernels of csrc/sm90_*.cu were built for sm_90a).
std::string cuda_build_info() {
  return std::string("archs=") + compiled_arch_list() + ";cutlass=" + cutlass_version() +
         ";dtypes=float16,bfloat16;sm90a=" + (sm90_kernels_built() ? "1" : "0");
}

}  // namespace
}  // namespace fused_preact

TORCH_LIBRARY_FRAGMENT(fused_preact, m) {
  m.def("cuda_build_info() -> str", &fused_preact::cuda_build_info);
  // Per-channel (mean, biased var), fp32, of a channels_last (N, C, H, W) float16/bfloat16/float32 x.
  m.def("cuda_batch_stats(Tensor x) -> (Tensor mean, Tensor var)");
  // y = conv2d(relu(x*scale + shift), weight) + bias; x, weight channels_last, scale/shift fp32 (C,).
  m.def(
      "cuda_fprop(Tensor x, Tensor weight, Tensor? bias, Tensor scale, Tensor shift, int[2] stride, "
      "int[2] padding, int[2] dilation) -> Tensor");
  // da = dgrad(grad_out, weight); dz = (x*scale + shift <= 0 ? 0 : da); (Σdz, Σdz·x̂) per channel.
  // Returns dz when batch_stats, else dx = scale*dz; both in x's dtype.
  m.def(
      "cuda_dgrad_stats(Tensor grad_out, Tensor x, Tensor weight, Tensor scale, Tensor shift, Tensor mean, "
      "Tensor invstd, int[2] stride, int[2] padding, int[2] dilation, bool batch_stats) "
      "-> (Tensor out, Tensor sum_dz, Tensor sum_dzx)");
  // dx = scale*(dz - Σdz/M - x̂·Σdz·x̂/M) in x's dtype.
  m.def(
      "cuda_dx(Tensor dz, Tensor x, Tensor scale, Tensor mean, Tensor invstd, Tensor sum_dz, Tensor sum_dzx) "
      "-> Tensor");
  // dw (fp32, channels_last (K, C, R, S)) = wgrad(grad_out, relu(x*scale + shift)).
  m.def(
      "cuda_wgrad(Tensor grad_out, Tensor x, Tensor scale, Tensor shift, int[] weight_size, int[2] stride, "
      "int[2] padding, int[2] dilation) -> Tensor");
}
