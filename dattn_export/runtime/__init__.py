"""Running exported graphs: `GraphRuntime` drives them (image -> visual K/V once, prefill, decode); a backend only
says how to run one graph: ONNX Runtime (`ort.py`) or TensorRT engines (`tensorrt.py`)."""
