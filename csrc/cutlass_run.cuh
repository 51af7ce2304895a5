// Checked launch of a CUTLASS device operator, shared by the CUTLASS 2.x convolutions
// (device::ImplicitGemmConvolution[Fusion], cutlass_conv.cuh) and the CUTLASS 3.x ones
// (conv::device::ConvUniversalAdapter, sm90_common.cuh): both expose static can_implement(args),
// initialize(args, workspace, stream) and run(stream). Torch-free.
#pragma once

#include "cutlass/cutlass.h"

#include <cuda_runtime.h>

namespace fused_preact {

// can_implement, initialize (dynamic smem limit, workspace/semaphore clearing) and launch on
// `stream`. Returns nullptr on success; `declined` (when given) if can_implement refuses, so that the
// caller can take another kernel, nothing having been launched; otherwise a static description.
template <typename Operation>
char const *initialize_and_run(typename Operation::Arguments const &args, void *workspace, cudaStream_t stream,
                               char const *declined = nullptr) {
  cutlass::Status status = Operation::can_implement(args);
  if (status != cutlass::Status::kSuccess) {
    return declined != nullptr ? declined : cutlass::cutlassGetStatusString(status);
  }
  Operation op;
  status = op.initialize(args, workspace, stream);
  if (status != cutlass::Status::kSuccess) {
    return cutlass::cutlassGetStatusString(status);
  }
  status = op.run(stream);
  if (status != cutlass::Status::kSuccess) {
    cudaError_t const error = cudaGetLastError();
    return error != cudaSuccess ? cudaGetErrorString(error) : cutlass::cutlassGetStatusString(status);
  }
  return nullptr;
}

}  // namespace fused_preact
