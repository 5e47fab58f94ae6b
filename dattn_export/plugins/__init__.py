"""The fused op `dattn::DecomposedAttention`: its contract (`contract.py`) and its backends, each held to the
contract's reference: the ONNX node and function body, the Triton kernel, the TensorRT plugin, the torch op."""
