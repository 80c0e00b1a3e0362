// The Python module `megatron_tma._C` exists only so that importing it loads this library; every op is
// registered through TORCH_LIBRARY_FRAGMENT(megatron_tma, ...) in the sibling binding files and reached as
// torch.ops.megatron_tma.<name>, which composes with torch.compile and CUDA graphs.
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.doc() = "megatron_tma CUDA kernels (ops under torch.ops.megatron_tma)"; }
