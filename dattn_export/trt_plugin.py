"""The TensorRT plugin `dattn::DecomposedAttention` (version 1): TensorRT's quickly deployable plugin API with an
ahead-of-time implementation, so engines carry the Triton kernel as PTX and run without Python.

Same name, namespace and version as the ONNX node, so the ONNX parser maps each node to it (TensorRT >= 10.15
with the ENABLE_PLUGIN_OVERRIDE parser flag prefers the plugin over the node's model-local function). Everything
that does not need TensorRT (attribute checks, shape inference, the launch grid and the kernel's scalar arguments)
is plain Python here and tested on CPU; `register()` binds it to `tensorrt.plugin`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .attention import MERGE_MODES, OP_DOMAIN, OP_TYPE
from .kernels import compile_ptx

PLUGIN_ID = f"{OP_DOMAIN}::{OP_TYPE}"
BLOCK_M = 16
DTYPES = {"float32", "float16", "bfloat16"}


@dataclass(frozen=True)
class Attributes:
    """A node's attributes, checked: what the kernel is specialised on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    softcap: float
    window: int
    merge: str
    causal_visual: int
    causal: int = 1

    def __post_init__(self):
        if self.merge not in MERGE_MODES:
            raise ValueError(f"{PLUGIN_ID}: merge {self.merge!r} is not one of {MERGE_MODES}")
        if self.head_dim < 16 or self.head_dim & (self.head_dim - 1):
            raise ValueError(f"{PLUGIN_ID}: head_dim {self.head_dim} must be a power of two >= 16 (kernel tiles)")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{PLUGIN_ID}: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.softcap < 0 or self.window < 0 or self.scale <= 0:
            raise ValueError(f"{PLUGIN_ID}: scale must be > 0, softcap and window >= 0 (0 = off)")


def output_shape(q_shape, k_shape, k_vis_shape, attributes: Attributes):
    """Shape inference: the output is shaped like q (B, Hq, T, D); the other inputs must agree with it."""
    batch, heads, _, head_dim = q_shape
    if heads != attributes.num_heads or head_dim != attributes.head_dim:
        raise ValueError(f"{PLUGIN_ID}: q is {tuple(q_shape)}, attributes say {attributes.num_heads} heads of {attributes.head_dim}")
    for name, shape in (("k", k_shape), ("k_vis", k_vis_shape)):
        if shape[1] != attributes.num_kv_heads or shape[3] != head_dim:
            raise ValueError(f"{PLUGIN_ID}: {name} is {tuple(shape)}, expected {attributes.num_kv_heads} KV heads of {head_dim}")
    return tuple(q_shape)


def launch_grid(q_shape, cdiv=lambda a, b: -(-a // b)):
    """(grid_x, grid_y): query blocks x (batch * heads). `cdiv` works on ints or TensorRT shape expressions."""
    batch, heads, queries, _ = q_shape
    return cdiv(queries, BLOCK_M), batch * heads


def int_arguments(q_shape, k_shape, k_vis_shape) -> list:
    """The kernel's scalar arguments (INT_ARGS order) for contiguous inputs, from shapes (ints or expressions)."""
    batch, heads, queries, head_dim = q_shape
    _, kv_heads, keys, _ = k_shape
    num_visual = k_vis_shape[2]
    return [heads, heads // kv_heads, queries, keys, num_visual,
            heads * queries * head_dim, queries * head_dim, head_dim,
            kv_heads * keys * head_dim, keys * head_dim, head_dim,
            kv_heads * num_visual * head_dim, num_visual * head_dim, head_dim]  # fmt: skip


_registered = False


def register() -> None:
    """Register the plugin with TensorRT's `tensorrt.plugin` (once per process)."""
    global _registered
    if _registered:
        return
    import tensorrt as trt
    import tensorrt.plugin as trtp

    dtype_names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}

    @trtp.register(PLUGIN_ID)
    def describe(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, key_mask: trtp.TensorDesc,
                 q_vis: trtp.TensorDesc, k_vis: trtp.TensorDesc, v_vis: trtp.TensorDesc, visual_mask: trtp.TensorDesc,
                 num_heads: int, num_kv_heads: int, head_dim: int, scale: float, softcap: float, window: int,
                 merge: str, causal_visual: int, causal: int) -> tuple[trtp.TensorDesc]:  # fmt: skip
        Attributes(num_heads, num_kv_heads, head_dim, scale, softcap, window, merge, causal_visual, causal)
        if dtype_names.get(q.dtype) not in DTYPES:
            raise ValueError(f"{PLUGIN_ID}: inputs of type {q.dtype} are not supported (fp32, fp16, bf16)")
        return q.like()

    @trtp.aot_impl(PLUGIN_ID)
    def ahead_of_time(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, key_mask: trtp.TensorDesc,
                      q_vis: trtp.TensorDesc, k_vis: trtp.TensorDesc, v_vis: trtp.TensorDesc, visual_mask: trtp.TensorDesc,
                      num_heads: int, num_kv_heads: int, head_dim: int, scale: float, softcap: float, window: int,
                      merge: str, causal_visual: int, causal: int, outputs: tuple[trtp.TensorDesc], tactic: int):  # fmt: skip
        Attributes(num_heads, num_kv_heads, head_dim, scale, softcap, window, merge, causal_visual, causal)
        name, ptx, metadata = compile_ptx(dtype_names[q.dtype], head_dim, scale=scale, softcap=softcap, window=window,
                                          merge=merge, causal_visual=bool(causal_visual), causal=bool(causal),
                                          block_m=BLOCK_M)  # fmt: skip
        q_shape, k_shape, k_vis_shape = (list(t.shape_expr) for t in (q, k, k_vis))
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y = launch_grid(q_shape, cdiv=trtp.cdiv)
        params.block_x = metadata.num_warps * 32
        params.shared_mem = metadata.shared
        arguments = int_arguments(q_shape, k_shape, k_vis_shape)
        extra = trtp.SymIntExprs(len(arguments))
        for i, value in enumerate(arguments):
            extra[i] = trtp.SymInt32(value)
        return name, ptx, params, extra

    _registered = True
