"""ONNX Runtime's CPU provider behind `GraphRuntime`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import memory
from ..artifacts import OnnxManifest
from ..errors import EnvironmentFailure, InputError
from .graph import GraphRuntime

# ONNX Runtime's CPU provider holds a graph's weights, and fp32 copies of fp16 ones (it has few fp16 kernels): a
# session's bytes per byte of its graph's data, by the data's type (docs/design/memory.md has the measurements)
SESSION_BYTES_PER_DATA_BYTE = {"float16": 2.0, "float32": 1.0}


def external_tensors(graph) -> dict[str, tuple[str, int, int]]:
    """The graph's initializers kept in external data: name -> (file, offset, length)."""
    import onnx

    found = {}
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = onnx.external_data_helper.ExternalDataInfo(tensor)
            found[tensor.name] = (info.location, info.offset, info.length)
    return found


def weight_bytes(path: Path) -> int:
    """The bytes of weights a session of the graph holds: its own file's and every range of external data it reads
    (context_kv.onnx reads most of its weights from decoder.onnx.data)."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        graph = onnx.load(path, load_external_data=False).graph
    except DecodeError:  # not a graph: ONNX Runtime names the problem when it loads it
        return path.stat().st_size
    return path.stat().st_size + sum(length for _, _, length in external_tensors(graph).values())


DEVICES = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


class OrtModel(GraphRuntime):
    """ONNX Runtime: its CPU provider, or on `device` "cuda" its CUDA provider (onnxruntime-gpu), which runs every
    node it has a kernel for on the GPU and leaves the rest (our fused op's function body included where it has none)
    to the CPU provider."""

    manifest_class = OnnxManifest

    def __init__(self, folder: Path, threads: int | None = None, device: str = "cpu"):
        import onnxruntime as ort

        super().__init__(folder)
        if device == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise EnvironmentFailure(
                "--device cuda",
                f"ONNX Runtime {ort.__version__} here has no CUDA provider (it has "
                f"{', '.join(ort.get_available_providers())}): on a machine with an NVIDIA GPU, pip install "
                "onnxruntime-gpu (the [gpu] extra), which replaces onnxruntime",
            )
        if self.dtype is None:
            raise InputError(
                self.folder,
                "holds bfloat16 graphs, which ONNX Runtime's CPU provider cannot run (no "
                "bf16 kernels): validate them with --backend trt on a GPU, or export fp32/fp16",
            )
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3
        graphs = [self.folder / g.file for g in self.manifest.graphs.values()]
        data = sum(weight_bytes(path) for path in graphs if path.is_file())  # a missing one is named below
        memory.require(  # on the GPU too: the CPU provider keeps the nodes the CUDA one has no kernel for
            int(SESSION_BYTES_PER_DATA_BYTE.get(self.manifest.dtype, 2.0) * data),
            f"ONNX Runtime's sessions for {self.folder} ({memory.gib(data)} of graphs, {self.manifest.dtype})",
            "use a machine with more memory"
            if self.manifest.quantization
            else "export with --quantize int4, or use a machine with more memory",
        )
        self.sessions = {}
        for name, graph in self.manifest.graphs.items():
            path = self.folder / graph.file
            try:
                self.sessions[name] = ort.InferenceSession(str(path), options, providers=DEVICES[device])
            except Exception as e:  # onnxruntime raises its own exception types for unreadable graphs
                raise InputError(path, f"ONNX Runtime cannot load it ({str(e).splitlines()[0]})") from None

    def _run(self, graph: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.sessions[graph].run(None, feeds)
