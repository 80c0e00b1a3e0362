// The group description every kernel takes (host-safe: included by the torch bindings too).
#pragma once

namespace megatron_tma {

struct GroupsArg {
  const void* ptr;  // device pointer to sizes[G] or offsets[G+1]
  int num_groups;   // G
  int is_int64;     // element width: 0 -> int32, 1 -> int64
  int is_offsets;   // 0 -> sizes[G], 1 -> offsets[G+1]
};

}  // namespace megatron_tma
