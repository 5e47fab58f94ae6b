"""Running exported graphs: `GraphRuntime` drives them (image -> visual K/V once, prefill, decode); a backend only
says how to run one graph: ONNX Runtime (`ort.py`) or TensorRT engines (`tensorrt.py`)."""

from pathlib import Path


def open_graphs(folder: Path, backend: str, threads: int | None = None, device: str = "cpu"):
    """The `GraphRuntime` of the backend that runs our graphs (folders.BACKENDS): ONNX Runtime (ort) on `device`
    (its CPU or CUDA provider), or TensorRT engines (trt), each imported only when asked for."""
    if backend == "trt":
        from .tensorrt import TrtModel

        return TrtModel(folder)
    from .ort import OrtModel

    return OrtModel(folder, threads, device)
