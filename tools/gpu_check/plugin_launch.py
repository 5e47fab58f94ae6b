"""The TensorRT plugins' kernels launched as TensorRT launches them, without TensorRT (which the GPU machines lack):
the plugin's own ahead-of-time functions (`tensorrt_plugin.attention_launch`, `merge_launch`) called with concrete
shapes, and what they return launched through the CUDA driver (cuda-python's `cuda.bindings`): the PTX loaded with
cuModuleLoadData, its entry's dynamic shared memory allowed, cuLaunchKernel with the returned grid, block and shared
memory and the arguments in TensorRT's order (input pointers, the integers, output pointers). In the dry run the same
argument list goes to a CPU stand-in that interprets the kernel the PTX was compiled from, with the constants it was
compiled with, positionally bound to the entry's parameters.

A decode step and a prefill run as `trt` builds every fused node: the shares plugin, then the merge plugin.
"""

from __future__ import annotations

import ctypes

from dattn_export.plugins.contract import Attributes
from dattn_export.plugins.tensorrt_plugin import Launch, attention_launch, merge_launch, shares_shapes


class DriverLauncher:
    """cuLaunchKernel of a Launch's PTX (modules loaded once per PTX), on the current torch stream."""

    def __init__(self):
        from cuda.bindings import driver

        self.driver, self.functions = driver, {}

    def check(self, result):
        error, *values = result if isinstance(result, tuple) else (result,)
        if error != self.driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {error}")
        return values[0] if len(values) == 1 else values

    def function(self, launch: Launch):
        key = launch.compiled.ptx
        if key not in self.functions:
            driver = self.driver
            module = self.check(driver.cuModuleLoadData(launch.compiled.ptx.encode() + b"\0"))
            function = self.check(driver.cuModuleGetFunction(module, launch.compiled.name.encode()))
            attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self.check(driver.cuFuncSetAttribute(function, attribute, launch.compiled.shared))
            self.functions[key] = function
        return self.functions[key]

    def __call__(self, launch: Launch, arguments: list) -> None:
        import torch

        values = [a.data_ptr() if isinstance(a, torch.Tensor) else int(a) for a in arguments]
        kinds = [ctypes.c_void_p if isinstance(a, torch.Tensor) else ctypes.c_int32 for a in arguments]
        stream = torch.cuda.current_stream().cuda_stream
        grid = [int(g) for g in launch.grid]
        self.check(self.driver.cuLaunchKernel(self.function(launch), *grid, launch.block, 1, 1, launch.compiled.shared,
                                              stream, (tuple(values), tuple(kinds)), 0))  # fmt: skip


def interpreted(launch: Launch, arguments: list) -> None:
    """The CPU stand-in (TRITON_INTERPRET=1): the kernel the PTX came from, its grid, the same arguments bound in the
    same order to the entry's parameters. Triton's interpreter multiplies bf16 tiles wrongly: bf16 is upcast there, as
    `triton_kernel.launch` does."""
    import torch

    assert len(arguments) == len(launch.parameters) == launch.compiled.parameter_count, (arguments, launch.parameters)
    constants = dict(launch.constants)
    if "UPCAST" in constants:
        constants["UPCAST"] = any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in arguments)
    bound = dict(zip(launch.parameters, arguments))
    launch.kernel[tuple(int(g) for g in launch.grid)](**bound, **constants, num_warps=launch.compiled.num_warps)


def plugin_attention(inputs: tuple, attributes: Attributes, chosen, launcher, arch: int | None = None):
    """The op's output for `inputs` (contiguous, on the launcher's device) as an engine computes it: the shares
    plugin's kernel at tiles `chosen`, then the merge plugin's, each launched by `launcher` with the arguments TensorRT
    passes. Returns (output, the two launches)."""
    import torch

    q, k, _, _, _, k_vis, _, _ = inputs
    dtype = str(q.dtype).removeprefix("torch.")
    shapes = (list(q.shape), list(k.shape), list(k_vis.shape))
    shares = attention_launch(dtype, *shapes, q.shape[-1], attributes, chosen, split_keys=True, arch=arch)
    shares_shape, lse_shape = shares_shapes(*shapes, attributes)
    partial = torch.empty(shares_shape, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    launcher(shares, [*inputs, *shares.ints, partial, partial_lse])
    merged = merge_launch(dtype, list(shares_shape), q.shape[-1], attributes, arch=arch)
    out = torch.empty_like(q)
    launcher(merged, [partial, partial_lse, *merged.ints, out])
    return out, (shares, merged)
