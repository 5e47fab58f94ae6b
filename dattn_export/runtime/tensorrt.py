"""Run TensorRT engines built by `dattn-export trt` (GPU only), behind the same runtime as ONNX Runtime."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np

from ..artifacts import TrtManifest
from ..errors import EnvironmentFailure
from ..extras import EXTRAS, require
from .graph import GraphRuntime


def import_tensorrt(module: str = "tensorrt"):
    """TensorRT's Python module (or TensorRT-RTX's, `tensorrt_rtx_bindings`), or one line saying how to install it."""
    if module == "tensorrt":
        require("tensorrt")
    try:
        return importlib.import_module(module)
    except ImportError as e:  # installed without its libraries (the bindings wheel alone)
        raise EnvironmentFailure(
            module, f"is installed but not importable ({e}): {EXTRAS['tensorrt'].install}"
        ) from None


def require_tensorrt_gpu(plugin: bool = False):
    """TensorRT and a CUDA GPU (and with `plugin`, Triton, which compiles the plugin's kernel), or a one-line error
    saying which is missing."""
    trt = import_tensorrt("tensorrt")
    if plugin:
        require("triton", unless="--no-plugin")
    import torch

    if not torch.cuda.is_available():
        raise EnvironmentFailure("GPU", "no CUDA GPU is visible: TensorRT builds and runs these engines on a GPU")
    return trt


class TrtModel(GraphRuntime):
    manifest_class = TrtManifest

    def __init__(self, folder: Path):
        super().__init__(folder)
        import torch

        trt = require_tensorrt_gpu(plugin=self.manifest.plugin)
        if self.manifest.plugin:  # engines that use the plugin need it registered to deserialize
            from ..plugins.tensorrt_plugin import register

            register()
        self.torch, self.trt = torch, trt
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
        self.engines, self.contexts, self.step_contexts = {}, {}, {}
        for name, file in self.manifest.engines.items():
            engine = self.runtime.deserialize_cuda_engine((self.folder / file).read_bytes())
            self.engines[name], self.contexts[name] = engine, engine.create_execution_context()
            if engine.num_optimization_profiles > 1:  # the plugin's decoder: a decode step's profile (trt_build)
                step = engine.create_execution_context()
                step.set_optimization_profile_async(1, torch.cuda.current_stream().cuda_stream)
                self.step_contexts[name] = step
        self.dtype = self.dtype or np.float32  # bf16 engines take fp32 host arrays, cast on the device

    def _run(self, graph: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        torch, trt = self.torch, self.trt
        engine, context = self.engines[graph], self.contexts[graph]
        if graph in self.step_contexts and feeds["input_ids"].shape[1] == 1:  # a decode step: its own tactics
            context = self.step_contexts[graph]
        as_torch = {
            trt.float32: torch.float32,
            trt.float16: torch.float16,
            trt.bfloat16: torch.bfloat16,
            trt.int64: torch.int64,
            trt.int32: torch.int32,
            trt.int8: torch.int8,
            trt.bool: torch.bool,
        }
        buffers = []  # device memory lives until the stream is done; empty tensors still get a valid address

        def bind(name: str, tensor) -> None:
            buffers.append(tensor if tensor.numel() else torch.empty(1, device="cuda"))
            context.set_tensor_address(name, buffers[-1].data_ptr())

        for name, array in feeds.items():
            context.set_input_shape(name, tuple(array.shape))
            bind(
                name, torch.from_numpy(np.ascontiguousarray(array)).to("cuda", as_torch[engine.get_tensor_dtype(name)])
            )
        outputs = []
        for spec in self.manifest.graphs[graph].outputs:
            name = spec.name
            outputs.append(
                torch.empty(
                    tuple(context.get_tensor_shape(name)), dtype=as_torch[engine.get_tensor_dtype(name)], device="cuda"
                )
            )
            bind(name, outputs[-1])
        stream = torch.cuda.current_stream()
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to run {graph}")
        stream.synchronize()
        return [o.float().cpu().numpy() if o.dtype == torch.bfloat16 else o.cpu().numpy() for o in outputs]
