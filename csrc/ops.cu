// CUDA implementations of the fused_preact::cuda_* ops (schemas in fused_preact.cpp): argument
// checks, output allocation through PyTorch's caching allocator, and launches on the current CUDA
// stream of the input's device. The kernels themselves live in the torch-free files behind
// launchers.h. Every activation is a logical (N, C, H, W) tensor stored channels_last, every weight a
// logical (K, C, R, S) tensor stored channels_last (KRSC), as the CUTLASS NHWC kernels read them.
#include "launchers.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <tuple>

namespace fused_preact {
namespace {

constexpr int kChannelAlignment = 8;          // 16-byte accesses of 16-bit elements
constexpr int64_t kMaxTensorBytes = int64_t(1) << 31;  // CUTLASS's 32-bit tensor offsets

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kFloat:
      return DType::kFloat32;
    default:
      TORCH_CHECK(false, "fused_preact: unsupported dtype ", t);
  }
}

cudaStream_t current_stream(at::Tensor const &t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
}

int device_attribute(cudaDeviceAttr attr, int device) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

// The CUTLASS 3.x kernels (sm90_*.cu) serve compute capability 9.0 when they were built; the CUTLASS
// 2.x kernels serve everything else, and 9.0 where an sm90 kernel declines the problem (returns
// kSm90Unsupported). FUSED_PREACT_CUDA_SM90=0 forces the CUTLASS 2.x kernels (for comparisons).
bool use_sm90(at::Tensor const &t) {
  static bool const disabled = [] {
    char const *v = std::getenv("FUSED_PREACT_CUDA_SM90");
    return v != nullptr && std::strcmp(v, "0") == 0;
  }();
  if (disabled || !sm90_kernels_built()) {
    return false;
  }
  int const major = device_attribute(cudaDevAttrComputeCapabilityMajor, t.get_device());
  int const minor = device_attribute(cudaDevAttrComputeCapabilityMinor, t.get_device());
  return major == 9 && minor == 0;
}

void check_sm80(at::Tensor const &t, char const *op) {
  int const major = device_attribute(cudaDevAttrComputeCapabilityMajor, t.get_device());
  int const minor = device_attribute(cudaDevAttrComputeCapabilityMinor, t.get_device());
  TORCH_CHECK(major >= 8, op, ": the CUTLASS kernels need compute capability >= 8.0 (sm_80), device ",
              t.get_device(), " has ", major, ".", minor);
}

// CUTLASS reads 16-byte vectors: a view with a storage offset may not start on such a boundary.
void check_aligned(at::Tensor const &t, char const *name, char const *op) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
              " must start on a 16-byte boundary (a view with a storage offset? pass a copy)");
}

void check_activation(at::Tensor const &t, char const *name, char const *op) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D (N, C, H, W), got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(at::MemoryFormat::ChannelsLast), op, ": ", name,
              " must be channels_last-contiguous (NHWC in memory); call "
              ".contiguous(memory_format=torch.channels_last) first");
  TORCH_CHECK(t.numel() * int64_t(t.element_size()) < kMaxTensorBytes, op, ": ", name, " has ",
              t.numel() * t.element_size(), " bytes; the CUTLASS kernels address at most 2^31 bytes");
  check_aligned(t, name, op);
}

void check_half_dtype(at::Tensor const &t, char const *name, char const *op) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op, ": ", name,
              " must be float16 or bfloat16 (CUTLASS tensor-core kernels), got ", t.scalar_type());
}

void check_same(at::Tensor const &t, at::Tensor const &like, char const *name, char const *op) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
              " but x has ", like.scalar_type());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(), " but x is on ",
              like.device());
}

void check_vector(at::Tensor const &t, int64_t C, char const *name, char const *op, at::Tensor const &x) {
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ", x.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == C && t.is_contiguous(), op, ": ", name,
              " must be a contiguous (C,) vector with C = ", C, ", got shape ", t.sizes());
}

void check_channels(int64_t channels, char const *what, char const *op) {
  TORCH_CHECK(channels % kChannelAlignment == 0, op, ": ", what, " (", channels, ") must be a multiple of ",
              kChannelAlignment, " for the 16-byte aligned accesses the CUTLASS kernels use");
}

void check_pair(at::IntArrayRef v, char const *name, char const *op) {
  TORCH_CHECK(v.size() == 2, op, ": ", name, " must have 2 entries, got ", v.size());
}

// Output extent as torch computes it (floor division); 0 when the dilated filter does not fit
// (C++ division truncates toward zero, which would turn a numerator in (-stride, 0) into 1).
int out_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dilation) {
  int64_t const span = in + 2 * pad - dilation * (k - 1) - 1;
  return span < 0 ? 0 : int(span / stride + 1);
}

// Geometry from x (N, C, H, W) and a (K, C, R, S) weight size.
ConvGeometry geometry(at::Tensor const &x, at::IntArrayRef w, at::IntArrayRef stride, at::IntArrayRef padding,
                      at::IntArrayRef dilation, char const *op) {
  check_pair(stride, "stride", op);
  check_pair(padding, "padding", op);
  check_pair(dilation, "dilation", op);
  TORCH_CHECK(w.size() == 4, op, ": weight must be 4-D (K, C, R, S), got ", w.size(), "-D");
  TORCH_CHECK(w[1] == x.size(1), op, ": weight has ", w[1], " input channels but x has ", x.size(1),
              " (groups > 1 is not supported by the CUTLASS backend)");
  TORCH_CHECK(stride[0] >= 1 && stride[1] >= 1 && dilation[0] >= 1 && dilation[1] >= 1 && padding[0] >= 0 &&
                  padding[1] >= 0,
              op, ": need stride >= 1, dilation >= 1 and padding >= 0");
  ConvGeometry g{};
  g.N = int(x.size(0));
  g.C = int(x.size(1));
  g.H = int(x.size(2));
  g.W = int(x.size(3));
  g.K = int(w[0]);
  g.R = int(w[2]);
  g.S = int(w[3]);
  g.stride_h = int(stride[0]);
  g.stride_w = int(stride[1]);
  g.pad_h = int(padding[0]);
  g.pad_w = int(padding[1]);
  g.dilation_h = int(dilation[0]);
  g.dilation_w = int(dilation[1]);
  g.P = out_size(g.H, g.R, g.stride_h, g.pad_h, g.dilation_h);
  g.Q = out_size(g.W, g.S, g.stride_w, g.pad_w, g.dilation_w);
  TORCH_CHECK(g.P > 0 && g.Q > 0, op, ": output size ", g.P, "x", g.Q, " is empty");
  TORCH_CHECK(g.C > 0 && g.K > 0 && g.R > 0 && g.S > 0, op, ": empty channel or filter extent");
  TORCH_CHECK(g.R <= 32 && g.S <= 32, op, ": filters larger than 32x32 are not supported");
  check_channels(g.C, "input channels C", op);
  check_channels(g.K, "output channels K", op);
  return g;
}

void check_launch(char const *error, char const *op, ConvGeometry const *g = nullptr) {
  if (error == nullptr) {
    return;
  }
  if (g == nullptr) {
    TORCH_CHECK(false, op, ": kernel launch failed: ", error);
  }
  TORCH_CHECK(false, op, ": CUTLASS could not run the problem N=", g->N, " C=", g->C, " H=", g->H, " W=", g->W,
              " K=", g->K, " R=", g->R, " S=", g->S, " stride=(", g->stride_h, ",", g->stride_w, ") padding=(",
              g->pad_h, ",", g->pad_w, ") dilation=(", g->dilation_h, ",", g->dilation_w, "): ", error);
}

at::Tensor empty_nhwc(std::array<int64_t, 4> sizes, at::TensorOptions options) {
  return at::empty(sizes, options.memory_format(at::MemoryFormat::ChannelsLast));
}

// ----------------------------------------------------------------------------------- ops
std::tuple<at::Tensor, at::Tensor> cuda_batch_stats(at::Tensor const &x) {
  constexpr char const *op = "fused_preact::cuda_batch_stats";
  check_activation(x, "x", op);
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              op, ": x must be float16, bfloat16 or float32, got ", x.scalar_type());
  c10::cuda::CUDAGuard guard(x.device());
  int64_t const C = x.size(1);
  int64_t const M = x.size(0) * x.size(2) * x.size(3);
  auto const f32 = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({C}, f32);
  at::Tensor var = at::empty({C}, f32);
  if (C == 0) {
    return {mean, var};
  }
  at::Tensor partials = at::empty({3 * int64_t(reduction_chunks(M)) * C}, f32);
  check_launch(launch_batch_stats(to_dtype(x.scalar_type()), x.data_ptr(), M, int(C), partials.data_ptr<float>(),
                                  mean.data_ptr<float>(), var.data_ptr<float>(), current_stream(x)),
               op);
  return {mean, var};
}

at::Tensor cuda_fprop(at::Tensor const &x, at::Tensor const &weight, std::optional<at::Tensor> const &bias,
                      at::Tensor const &scale, at::Tensor const &shift, at::IntArrayRef stride,
                      at::IntArrayRef padding, at::IntArrayRef dilation) {
  constexpr char const *op = "fused_preact::cuda_fprop";
  check_activation(x, "x", op);
  check_half_dtype(x, "x", op);
  check_same(weight, x, "weight", op);
  TORCH_CHECK(weight.dim() == 4 && weight.is_contiguous(at::MemoryFormat::ChannelsLast), op,
              ": weight must be a channels_last-contiguous (K, C, R, S) tensor");
  check_aligned(weight, "weight", op);
  ConvGeometry const g = geometry(x, weight.sizes(), stride, padding, dilation, op);
  check_vector(scale, g.C, "scale", op, x);
  check_vector(shift, g.C, "shift", op, x);
  if (bias.has_value()) {
    check_same(*bias, x, "bias", op);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == g.K && bias->is_contiguous(), op,
                ": bias must be a contiguous (K,) vector with K = ", g.K);
    check_aligned(*bias, "bias", op);
  }
  check_sm80(x, op);
  c10::cuda::CUDAGuard guard(x.device());
  // CUTLASS's fused kernels do not check sizes themselves (unlike device::ImplicitGemmConvolution).
  TORCH_CHECK(int64_t(g.N) * g.P * g.Q * g.K * int64_t(x.element_size()) < kMaxTensorBytes, op,
              ": the output would exceed 2^31 bytes (CUTLASS's 32-bit tensor offsets)");
  at::Tensor y = empty_nhwc({g.N, g.K, g.P, g.Q}, x.options());
  if (y.numel() == 0) {
    return y;
  }
  void const *bias_ptr = bias.has_value() ? bias->data_ptr() : nullptr;
  if (use_sm90(x)) {
    // fp32 scale/shift, transform in fp32 (sm90_fprop_mainloop.cuh).
    char const *error = launch_fprop_fused_sm90(to_dtype(x.scalar_type()), g, x.data_ptr(), weight.data_ptr(),
                                                bias_ptr, nullptr, scale.data_ptr<float>(), shift.data_ptr<float>(),
                                                y.data_ptr(), current_stream(x));
    if (error != kSm90Unsupported) {
      check_launch(error, op, &g);
      return y;
    }
  }
  // CUTLASS 2.x's mainloop transform multiplies in the operand dtype.
  at::Tensor const scale_op = scale.to(x.scalar_type());
  at::Tensor const shift_op = shift.to(x.scalar_type());
  check_launch(launch_fprop_fused(to_dtype(x.scalar_type()), g, x.data_ptr(), weight.data_ptr(), bias_ptr,
                                  scale_op.data_ptr(), shift_op.data_ptr(), y.data_ptr(), current_stream(x)),
               op, &g);
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_dgrad_stats(
    at::Tensor const &grad_out, at::Tensor const &x, at::Tensor const &weight, at::Tensor const &scale,
    at::Tensor const &shift, at::Tensor const &mean, at::Tensor const &invstd, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, bool batch_stats) {
  constexpr char const *op = "fused_preact::cuda_dgrad_stats";
  check_activation(x, "x", op);
  check_half_dtype(x, "x", op);
  check_activation(grad_out, "grad_out", op);
  check_same(grad_out, x, "grad_out", op);
  check_same(weight, x, "weight", op);
  TORCH_CHECK(weight.dim() == 4 && weight.is_contiguous(at::MemoryFormat::ChannelsLast), op,
              ": weight must be a channels_last-contiguous (K, C, R, S) tensor");
  check_aligned(weight, "weight", op);
  ConvGeometry const g = geometry(x, weight.sizes(), stride, padding, dilation, op);
  TORCH_CHECK(grad_out.size(0) == g.N && grad_out.size(1) == g.K && grad_out.size(2) == g.P &&
                  grad_out.size(3) == g.Q,
              op, ": grad_out has shape ", grad_out.sizes(), ", expected (", g.N, ", ", g.K, ", ", g.P, ", ", g.Q, ")");
  TORCH_CHECK(!(g.stride_h * g.stride_w > 1 && g.dilation_h * g.dilation_w > 1), op,
              ": CUTLASS's strided dgrad does not support dilation > 1 together with stride > 1");
  check_vector(scale, g.C, "scale", op, x);
  check_vector(shift, g.C, "shift", op, x);
  check_vector(mean, g.C, "mean", op, x);
  check_vector(invstd, g.C, "invstd", op, x);
  check_sm80(x, op);
  c10::cuda::CUDAGuard guard(x.device());
  auto const f32 = x.options().dtype(at::kFloat);
  int64_t const M = int64_t(g.N) * g.H * g.W;
  // dz (training) or dx = scale*dz (eval), in x's dtype on both paths.
  at::Tensor out = empty_nhwc({g.N, g.C, g.H, g.W}, x.options());
  at::Tensor sum_dz = at::zeros({g.C}, f32);
  at::Tensor sum_dzx = at::zeros({g.C}, f32);
  if (M == 0) {
    return {out, sum_dz, sum_dzx};
  }
  cudaStream_t const stream = current_stream(x);
  DType const dtype = to_dtype(x.scalar_type());
  bool const unit = g.stride_h == 1 && g.stride_w == 1 && g.dilation_h == 1 && g.dilation_w == 1;
  if (unit && use_sm90(x)) {
    // Mask, dz and the per-channel sums in the dgrad epilogue; no fp32 da (sm90_conv_dgrad.cu).
    int rows = 0, ld = 0;
    sm90_dgrad_partials_shape(g, &rows, &ld);
    at::Tensor partials = at::empty({2, int64_t(rows), int64_t(ld)}, f32);
    char const *error = launch_dgrad_bn_sm90(
        dtype, g, grad_out.data_ptr(), weight.data_ptr(), x.data_ptr(), scale.data_ptr<float>(),
        shift.data_ptr<float>(), mean.data_ptr<float>(), invstd.data_ptr<float>(), !batch_stats, out.data_ptr(),
        partials.data_ptr<float>(), partials.data_ptr<float>() + int64_t(rows) * ld, stream);
    if (error != kSm90Unsupported) {
      check_launch(error, op, &g);
      check_launch(launch_sum_partials(partials.data_ptr<float>(), partials.data_ptr<float>() + int64_t(rows) * ld,
                                       rows, ld, g.C, sum_dz.data_ptr<float>(), sum_dzx.data_ptr<float>(), stream),
                   op);
      return {out, sum_dz, sum_dzx};
    }
  }
  TORCH_CHECK(M * g.C * 4 < kMaxTensorBytes, op, ": the fp32 dgrad output would exceed 2^31 bytes");
  at::Tensor da = empty_nhwc({g.N, g.C, g.H, g.W}, f32);
  check_launch(launch_dgrad(dtype, g, grad_out.data_ptr(), weight.data_ptr(), da.data_ptr<float>(), stream), op,
               &g);
  at::Tensor partials = at::empty({2 * int64_t(reduction_chunks(M)) * g.C}, f32);
  // The ReLU mask uses the fp32 scale/shift (see launchers.h), not the 16-bit copies of the fprop.
  check_launch(launch_dgrad_reduce(dtype, da.data_ptr<float>(), x.data_ptr(), scale.data_ptr<float>(),
                                   shift.data_ptr<float>(), mean.data_ptr<float>(), invstd.data_ptr<float>(), M,
                                   g.C, !batch_stats, out.data_ptr(), partials.data_ptr<float>(),
                                   sum_dz.data_ptr<float>(), sum_dzx.data_ptr<float>(), stream),
               op);
  return {out, sum_dz, sum_dzx};
}

at::Tensor cuda_dx(at::Tensor const &dz, at::Tensor const &x, at::Tensor const &scale, at::Tensor const &mean,
                   at::Tensor const &invstd, at::Tensor const &sum_dz, at::Tensor const &sum_dzx) {
  constexpr char const *op = "fused_preact::cuda_dx";
  check_activation(x, "x", op);
  check_activation(dz, "dz", op);
  TORCH_CHECK(dz.scalar_type() == x.scalar_type() || dz.scalar_type() == at::kFloat, op, ": dz must be float32 or ",
              x.scalar_type(), " (x's dtype), got ", dz.scalar_type());
  TORCH_CHECK(dz.sizes() == x.sizes(), op, ": dz has shape ", dz.sizes(), " but x has ", x.sizes());
  TORCH_CHECK(dz.device() == x.device(), op, ": dz is on ", dz.device(), " but x is on ", x.device());
  int64_t const C = x.size(1);
  check_vector(scale, C, "scale", op, x);
  check_vector(mean, C, "mean", op, x);
  check_vector(invstd, C, "invstd", op, x);
  check_vector(sum_dz, C, "sum_dz", op, x);
  check_vector(sum_dzx, C, "sum_dzx", op, x);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = empty_nhwc({x.size(0), C, x.size(2), x.size(3)}, x.options());
  int64_t const M = x.size(0) * x.size(2) * x.size(3);
  if (dx.numel() == 0) {
    return dx;
  }
  check_launch(launch_bn_dx(to_dtype(x.scalar_type()), to_dtype(dz.scalar_type()), dz.data_ptr(), x.data_ptr(),
                            scale.data_ptr<float>(),
                            mean.data_ptr<float>(), invstd.data_ptr<float>(), sum_dz.data_ptr<float>(),
                            sum_dzx.data_ptr<float>(), M, int(C), dx.data_ptr(), current_stream(x)),
               op);
  return dx;
}

// Serial split-K slices for wgrad: about two threadblocks per SM, at least 8 K-tiles per slice.
int wgrad_split_k(ConvGeometry const &g, int device) {
  int64_t const tiles = ((g.K + 127) / 128) * ((int64_t(g.C) * g.R * g.S + 127) / 128);
  int64_t const k_tiles = (int64_t(g.N) * g.P * g.Q + 31) / 32;
  int64_t const sms = device_attribute(cudaDevAttrMultiProcessorCount, device);
  int64_t const split = std::min<int64_t>({2 * sms / std::max<int64_t>(tiles, 1), k_tiles / 8, 64});
  return int(std::max<int64_t>(split, 1));
}

at::Tensor cuda_wgrad(at::Tensor const &grad_out, at::Tensor const &x, at::Tensor const &scale,
                      at::Tensor const &shift, at::IntArrayRef weight_size, at::IntArrayRef stride,
                      at::IntArrayRef padding, at::IntArrayRef dilation) {
  constexpr char const *op = "fused_preact::cuda_wgrad";
  check_activation(x, "x", op);
  check_half_dtype(x, "x", op);
  check_activation(grad_out, "grad_out", op);
  check_same(grad_out, x, "grad_out", op);
  ConvGeometry const g = geometry(x, weight_size, stride, padding, dilation, op);
  TORCH_CHECK(grad_out.size(0) == g.N && grad_out.size(1) == g.K && grad_out.size(2) == g.P &&
                  grad_out.size(3) == g.Q,
              op, ": grad_out has shape ", grad_out.sizes(), ", expected (", g.N, ", ", g.K, ", ", g.P, ", ", g.Q, ")");
  check_vector(scale, g.C, "scale", op, x);
  check_vector(shift, g.C, "shift", op, x);
  check_sm80(x, op);
  c10::cuda::CUDAGuard guard(x.device());
  auto const f32 = x.options().dtype(at::kFloat);
  if (int64_t(g.N) * g.P * g.Q == 0) {
    return at::zeros({g.K, g.C, g.R, g.S}, f32.memory_format(at::MemoryFormat::ChannelsLast));
  }
  at::Tensor dw = empty_nhwc({g.K, g.C, g.R, g.S}, f32);
  if (use_sm90(x)) {
    // fp32 scale/shift, transform of the x tile in smem (sm90_conv_wgrad.cu).
    int const splits = sm90_wgrad_splits(g, device_attribute(cudaDevAttrMultiProcessorCount, x.get_device()));
    size_t const bytes = sm90_wgrad_workspace_bytes(g, splits);
    at::Tensor workspace;
    if (bytes > 0) {
      workspace = at::empty({int64_t(bytes / sizeof(float))}, f32);
    }
    char const *error = launch_wgrad_fused_sm90(to_dtype(x.scalar_type()), g, grad_out.data_ptr(), x.data_ptr(),
                                                scale.data_ptr<float>(), shift.data_ptr<float>(),
                                                dw.data_ptr<float>(), splits,
                                                bytes > 0 ? workspace.data_ptr() : nullptr, current_stream(x));
    if (error != kSm90Unsupported) {
      check_launch(error, op, &g);
      return dw;
    }
  }
  int const split_k = wgrad_split_k(g, x.get_device());
  size_t const workspace_bytes = wgrad_workspace_bytes(g, split_k);
  at::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = at::empty({int64_t(workspace_bytes)}, x.options().dtype(at::kByte));
  }
  at::Tensor const scale_op = scale.to(x.scalar_type());
  at::Tensor const shift_op = shift.to(x.scalar_type());
  check_launch(launch_wgrad_fused(to_dtype(x.scalar_type()), g, grad_out.data_ptr(), x.data_ptr(),
                                  scale_op.data_ptr(), shift_op.data_ptr(), dw.data_ptr<float>(), split_k,
                                  workspace_bytes > 0 ? workspace.data_ptr() : nullptr, current_stream(x)),
               op, &g);
  return dw;
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_preact, CUDA, m) {
  m.impl("cuda_batch_stats", &cuda_batch_stats);
  m.impl("cuda_fprop", &cuda_fprop);
  m.impl("cuda_dgrad_stats", &cuda_dgrad_stats);
  m.impl("cuda_dx", &cuda_dx);
  m.impl("cuda_wgrad", &cuda_wgrad);
}

}  // namespace fused_preact
