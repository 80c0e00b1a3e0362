// The Python module `megatron_tma._C` exists only so that importing it loads this library: the sibling binding
// files register the CUDA kernels (TORCH_LIBRARY_IMPL(megatron_tma, CUDA, ...)) of the ops that megatron_tma/ops.py
// defines with their CPU and fake kernels, and define the two tile queries. Every op is reached as
// torch.ops.megatron_tma.<name>, which composes with torch.compile and CUDA graphs. (The dispatcher takes a
// kernel registered before its schema: the import order of _C and megatron_tma.ops does not matter.)
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.doc() = "megatron_tma CUDA kernels (ops under torch.ops.megatron_tma)"; }
