// Torch-free host entry points of the padded-path gather kernels (csrc/instantiations/pad_gather.cu).
// Plain C++ (no device code), so the torch binding can include it with the host compiler. `groups` is the
// device sizes [G] / offsets [G+1] tensor (common/groups_arg.h).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "megatron_tma/common/groups_arg.h"

namespace megatron_tma {

// Exact maximum of sum_g round_up(M_g, align) over all sizes M_g >= 0 with sum M_g = m and g < num_groups:
// at most min(num_groups, m) groups are non-empty, and each non-empty group wastes at most align - 1 rows,
// so the maximum is align * (floor((m - n) / align) + n) with n = min(num_groups, m) (reached by n - 1
// groups of one row and one group holding the rest). It never exceeds round_up(m, align) + align * G.
// megatron_tma.padding.padded_row_count_upper_bound is the same formula.
inline int64_t padded_rows_upper_bound(int64_t m, int64_t num_groups, int64_t align) {
  const int64_t nonempty = m < num_groups ? m : num_groups;
  return align * ((m - nonempty) / align + nonempty);
}

// Largest G the gather kernels accept: each CTA keeps two [G + 1] offset arrays in shared memory
// (about 70 KB at this limit, within the opt-in shared memory of every sm_90 part).
constexpr int kPadGatherMaxGroups = 8192;

// Largest row count of any buffer: the kernels index rows with int, with room to round up to a whole tile.
constexpr int64_t kPadGatherMaxRows = INT32_MAX - 1024;

// Gathers a (e4m3 [m, k], row-major) and its 1x128 scales (element (r, kb) at a_scales[kb * scales_ld + r])
// into a_pad (e4m3 [m_pad, k]) and a_scales_pad (element (p, kb) at a_scales_pad[kb * m_pad + p]), with
// each group's rows starting at a multiple of `align`; padding rows and rows past the padded total are
// zero with scale 1.0. Writes the padded offsets (int32 [num_groups + 1]). m_pad must be at least
// padded_rows_upper_bound(m, num_groups, align). Requires k % 16 == 0 and 16-byte aligned a / a_pad.
// Returns cudaErrorInvalidValue (nothing launched) on bad geometry. No host synchronisation and no device
// reads: safe under CUDA-graph capture.
cudaError_t pad_rows_fp8(const void* a, const float* a_scales, int64_t scales_ld, void* a_pad, float* a_scales_pad,
                         int32_t* padded_offsets, GroupsArg groups, int64_t m, int64_t m_pad, int64_t k,
                         int64_t align, cudaStream_t stream);

// Gathers the valid rows of y_pad (bf16 [y_pad_rows, n]) into out (bf16 [m, n]): row O_g + r of out is
// row P_g + r of y_pad, where O are the offsets of `groups` and P the int32 `padded_offsets` [G + 1] that
// pad_rows_fp8 wrote. Rows no group covers are written as zeros. Requires n % 8 == 0 (16-byte rows) and
// 16-byte aligned, non-overlapping y_pad / out. Same error and capture behaviour as pad_rows_fp8.
cudaError_t unpad_rows_bf16(const void* y_pad, int64_t y_pad_rows, GroupsArg groups, const int32_t* padded_offsets,
                            void* out, int64_t m, int64_t n, cudaStream_t stream);

}  // namespace megatron_tma
