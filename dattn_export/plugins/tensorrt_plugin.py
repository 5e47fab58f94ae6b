"""The TensorRT plugin `dattn::DecomposedAttention` (version 1): TensorRT's quickly deployable plugin API with an
ahead-of-time implementation, so engines carry the Triton kernel as PTX and run without Python.

Same name, namespace and version as the ONNX node, so the ONNX parser maps each node to it (TensorRT >= 10.15
with the ENABLE_PLUGIN_OVERRIDE parser flag prefers the plugin over the node's model-local function). The
plugin's arguments are the contract's inputs and attributes: `tensorrt.plugin` reads them from the functions'
signatures, which are built from the contract here (real classes as annotations, no defaults: the API allows
none). `register()` binds it to `tensorrt.plugin`; nothing else here needs TensorRT.
"""

from __future__ import annotations

import inspect
import typing

from . import contract
from .contract import Attributes
from .triton_kernel import compile_ptx, int_arguments, launch_grid

DTYPES = {"float32", "float16", "bfloat16"}


def signature(tensor_type: type, returns=inspect.Signature.empty, extra: tuple[inspect.Parameter, ...] = ()):
    """The plugin functions' signature: every input as `tensor_type`, then every node attribute with its type."""
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    hints = typing.get_type_hints(Attributes)
    attributes = [(name, int) for name in contract.SHAPE_ATTRIBUTES] + [
        (name, hints[name]) for name in Attributes.names()
    ]
    parameters = [inspect.Parameter(name, keyword, annotation=tensor_type) for name in contract.INPUTS]
    parameters += [inspect.Parameter(name, keyword, annotation=kind) for name, kind in attributes]
    return inspect.Signature([*parameters, *extra], return_annotation=returns)


def split_arguments(bound: inspect.BoundArguments) -> tuple[list, tuple[int, int, int], Attributes]:
    """(input descriptors, (num_heads, num_kv_heads, head_dim), checked Attributes) from bound plugin arguments."""
    args = bound.arguments
    shape = tuple(args[name] for name in contract.SHAPE_ATTRIBUTES)
    contract.check_shapes(*shape)
    return [args[name] for name in contract.INPUTS], shape, Attributes(**{n: args[n] for n in Attributes.names()})


_registered = False


def register() -> None:
    """Register the plugin with TensorRT's `tensorrt.plugin` (once per process)."""
    global _registered
    if _registered:
        return
    import tensorrt as trt
    import tensorrt.plugin as trtp

    dtype_names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    describe_signature = signature(trtp.TensorDesc, tuple[trtp.TensorDesc])
    aot_signature = signature(
        trtp.TensorDesc,
        extra=(
            inspect.Parameter("outputs", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=tuple[trtp.TensorDesc]),
            inspect.Parameter("tactic", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=int),
        ),
    )

    def describe(*args, **kwargs):
        (q, *_), _, _ = split_arguments(describe_signature.bind(*args, **kwargs))
        if dtype_names.get(q.dtype) not in DTYPES:
            raise ValueError(f"{contract.ID}: inputs of type {q.dtype} are not supported (fp32, fp16, bf16)")
        return q.like()

    def ahead_of_time(*args, **kwargs):
        (q, k, _, _, _, k_vis, _, _), (_, _, head_dim), attributes = split_arguments(
            aot_signature.bind(*args, **kwargs)
        )
        name, ptx, metadata = compile_ptx(dtype_names[q.dtype], head_dim, attributes)
        q_shape, k_shape, k_vis_shape = (list(t.shape_expr) for t in (q, k, k_vis))
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y = launch_grid(q_shape, k_shape, cdiv=trtp.cdiv)
        params.block_x = metadata.num_warps * 32
        params.shared_mem = metadata.shared
        arguments = int_arguments(q_shape, k_shape, k_vis_shape)
        extra = trtp.SymIntExprs(len(arguments))
        for i, value in enumerate(arguments):
            extra[i] = trtp.SymInt32(value)
        return name, ptx, params, extra

    describe.__signature__, ahead_of_time.__signature__ = describe_signature, aot_signature
    trtp.register(contract.ID)(describe)
    trtp.aot_impl(contract.ID)(ahead_of_time)
    _registered = True
