"""The TensorRT plugins of dattn::DecomposedAttention: TensorRT's quickly deployable plugin API with ahead-of-time
implementations, so engines carry the Triton kernels as PTX and run without Python.

  dattn::DecomposedAttention        the op in one kernel, as the ONNX node names it (version 1)
  dattn::DecomposedAttentionShares  the same op with its keys split into shares, a program each: every share's
                                    output and log-sum-exp per slot, (splits, SLOTS, B*Hq, T, D) and (..., T), fp32
  dattn::MergeShares                the shares merged by their log-sum-exps: the op's output

Why two plugins for split keys: an ahead-of-time plugin launches one kernel, gets no workspace, and its outputs hold
nothing before it writes them. A decode step's keys are split into shares (flash-decoding: one program per kv head
would leave most of the GPU idle) and the shares merged, as `triton_kernel.launch` does with two kernels; a merge by
the last program to finish a row needs counters that start at zero, which nothing gives a plugin. So `trt` builds
each fused node as the shares plugin followed by the merge plugin (`stages/trt_build.split_key_nodes`); TensorRT
allocates the shares between them as it does any activation, written whole before they are read. The share count is
computed from the shapes at each launch (`key_splits`): a decode step's keys in shares of about 1024, a prefill's in
one.

Tactics: each attention kernel is compiled for every tile shape of `tactics` (the tiles `triton_kernel.tiles` takes
for a decode step and for a prefill, the fastest an H200 sweep found, and the other shapes that sweep timed);
TensorRT times them at build time on the user's GPU and keeps the fastest for each optimization profile (the decoder
has a prefill profile and a decode one).

`attention_launch` and `merge_launch` are what the ahead-of-time implementations return, computed from shapes that
are ints or TensorRT's shape expressions: the GPU check calls them with a model's shapes and launches the result as
TensorRT does (the PTX through the CUDA driver, the integers between the input and the output pointers), without
TensorRT. `register()` binds them to `tensorrt.plugin`; nothing else here needs TensorRT.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from ..artifacts import named_dtype
from . import contract
from .contract import Attributes
from .ptx import (
    Compiled,
    attention_constants,
    attention_signature,
    compile_attention,
    compile_merge,
    merge_constants,
    merge_signature,
)
from .triton_kernel import (
    BLOCK_M,
    Tiles,
    dattn_kernel,
    int_arguments,
    key_splits,
    launch_grid,
    merge_shares_kernel,
    tiles,
)

SHARES, MERGE = "DecomposedAttentionShares", "MergeShares"  # the split-key plugins' names, in contract.DOMAIN
MERGE_ATTRIBUTES = {"num_heads": int, "head_dim": int, "merge": str, "num_contexts": int, "dtype": str}
# the other tile shapes bench/kernel_blocks.py timed beside tiles()' choice (half precision; fp32 halves the keys)
SWEPT = {"decode": ((16, 128, 4), (16, 64, 4)), "prefill": ((64, 64, 4), (128, 64, 8), (16, 64, 4))}


def tactics(head_dim: int, element_bytes: int) -> tuple[Tiles, ...]:
    """The tile shapes a plugin's attention kernel is compiled for, tactic i being the i-th: `tiles`' choices for a
    decode step and for a prefill first, then the other shapes the sweep timed. A head dim of 256 takes no more
    than 64 queries a program (registers), as `tiles` does."""
    per_key = max(1, element_bytes // 2)
    chosen = [tiles(1, head_dim, element_bytes), tiles(BLOCK_M + 1, head_dim, element_bytes)]
    swept = [Tiles(m, n // per_key, w) for phase in ("decode", "prefill") for m, n, w in SWEPT[phase]]
    swept = [t for t in swept if head_dim <= 128 or t.block_m <= 64]
    return tuple(dict.fromkeys(chosen + swept))


def cdiv(a, b):
    """Ceiling division of ints or of TensorRT's shape expressions (which have no negation)."""
    return (a + b - 1) // b


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as an ahead-of-time plugin describes it: the compiled kernel, its grid (ints, or shape
    expressions), and the integers passed between the input and the output pointers. `kernel` and `constants` are
    what it was compiled from: the CPU stand-in of the GPU check interprets them with the same arguments."""

    compiled: Compiled
    grid: tuple
    ints: list
    kernel: Callable
    parameters: tuple[str, ...]  # the entry's parameters by name, in order: input pointers, ints, output pointers
    constants: dict

    @property
    def block(self) -> int:
        return self.compiled.num_warps * 32


def attention_launch(dtype: str, q_shape, k_shape, k_vis_shape, head_dim: int, attributes: Attributes,
                     chosen: Tiles, split_keys: bool, arch: int | None = None) -> Launch:  # fmt: skip
    """The attention kernel's launch for inputs of these shapes: (batch x kv heads) programs of `chosen.block_m`
    (query, head) rows each, and with `split_keys` as many shares of the keys as `key_splits` gives."""
    compiled = compiled_attention(dtype, head_dim, attributes, chosen, split_keys, arch)
    grid_x, grid_y = launch_grid(q_shape, k_shape, cdiv=cdiv, block_m=chosen.block_m)
    shares = key_splits(q_shape[2], k_shape[2] + k_vis_shape[2]) if split_keys else 1
    constants = attention_constants(dtype, head_dim, attributes, chosen, split_keys)
    return Launch(compiled, (grid_x, grid_y, shares), int_arguments(q_shape, k_shape, k_vis_shape), dattn_kernel,
                  tuple(attention_signature(dtype, split_keys)), constants)  # fmt: skip


def shares_shapes(q_shape, k_shape, k_vis_shape, attributes: Attributes) -> tuple[tuple, tuple]:
    """The shares' shapes and their log-sum-exps': (splits, SLOTS, B * Hq, T, D) and (splits, SLOTS, B * Hq, T)."""
    batch, heads, queries, head_dim = q_shape
    splits = key_splits(queries, k_shape[2] + k_vis_shape[2])
    lse = (splits, attributes.slots, batch * heads, queries)
    return (*lse, head_dim), lse


def merge_launch(dtype: str, shares_shape, head_dim: int, attributes: Attributes, arch: int | None = None) -> Launch:
    """The merge's launch: a program per output row (of B * Hq * T), over every share of each slot."""
    splits, _, rows, queries, _ = shares_shape
    num_rows = rows * queries
    compiled = compiled_merge(dtype, head_dim, attributes, arch)
    return Launch(compiled, (num_rows, 1, 1), [num_rows, splits], merge_shares_kernel,
                  tuple(merge_signature(dtype)), merge_constants(head_dim, attributes))  # fmt: skip


@cache
def compiled_attention(dtype: str, head_dim: int, attributes: Attributes, chosen: Tiles, split_keys: bool,
                       arch: int | None) -> Compiled:  # fmt: skip
    """Each (attributes, tiles) compiled once per process: TensorRT asks for every tactic of every node."""
    return compile_attention(dtype, head_dim, attributes, chosen, split_keys, arch)


@cache
def compiled_merge(dtype: str, head_dim: int, attributes: Attributes, arch: int | None) -> Compiled:
    return compile_merge(dtype, head_dim, attributes, arch)


# --- tensorrt.plugin: signatures built from the contract, the three registrations --------------------------------


def signature(tensor_type: type, returns=inspect.Signature.empty, extra: tuple[inspect.Parameter, ...] = ()):
    """The attention plugins' signature: every input as `tensor_type`, then every node attribute with its type."""
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    hints = typing.get_type_hints(Attributes)
    attributes = [(name, int) for name in contract.SHAPE_ATTRIBUTES] + [
        (name, hints[name]) for name in Attributes.names()
    ]
    parameters = [inspect.Parameter(name, keyword, annotation=tensor_type) for name in contract.INPUTS]
    parameters += [inspect.Parameter(name, keyword, annotation=kind) for name, kind in attributes]
    return inspect.Signature([*parameters, *extra], return_annotation=returns)


def merge_plugin_signature(
    tensor_type: type, returns=inspect.Signature.empty, extra: tuple[inspect.Parameter, ...] = ()
):
    """The merge plugin's signature: the shares and their log-sum-exps, then MERGE_ATTRIBUTES."""
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = [inspect.Parameter(name, keyword, annotation=tensor_type) for name in ("shares", "shares_lse")]
    parameters += [inspect.Parameter(name, keyword, annotation=kind) for name, kind in MERGE_ATTRIBUTES.items()]
    return inspect.Signature([*parameters, *extra], return_annotation=returns)


def split_arguments(bound: inspect.BoundArguments) -> tuple[list, tuple[int, int, int], Attributes]:
    """(input descriptors, (num_heads, num_kv_heads, head_dim), checked Attributes) from bound plugin arguments."""
    args = bound.arguments
    shape = tuple(args[name] for name in contract.SHAPE_ATTRIBUTES)
    contract.check_shapes(*shape)
    return [args[name] for name in contract.INPUTS], shape, Attributes(**{n: args[n] for n in Attributes.names()})


def merge_attributes(bound: inspect.BoundArguments) -> Attributes:
    """The merge's attributes as the op's (its scale does not matter to the merge)."""
    args = bound.arguments
    return Attributes(1.0, merge=args["merge"], num_contexts=args["num_contexts"])


_registered = False


def register() -> None:
    """Register the three plugins with TensorRT's `tensorrt.plugin` (once per process)."""
    global _registered
    if _registered:
        return
    import tensorrt as trt
    import tensorrt.plugin as trtp

    dtype_names = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}
    type_codes = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16"}
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    outputs_parameter = inspect.Parameter("outputs", keyword, annotation=tuple[trtp.TensorDesc])
    tactic_parameter = inspect.Parameter("tactic", keyword, annotation=int)

    def checked_dtype(q) -> str:
        if q.dtype not in dtype_names:
            raise ValueError(f"{contract.ID}: inputs of type {q.dtype} are not supported (fp32, fp16, bf16)")
        return dtype_names[q.dtype]

    def to_tensorrt(launch: Launch):
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y, params.grid_z = launch.grid
        params.block_x, params.shared_mem = launch.block, launch.compiled.shared
        extra = trtp.SymIntExprs(len(launch.ints))
        for i, value in enumerate(launch.ints):
            extra[i] = trtp.SymInt32(value)
        return launch.compiled.name, launch.compiled.ptx, params, extra

    def tactic_combinations(head_dim: int, outputs: str = ""):
        """Every tactic, for each float type: the floats alike, the masks' types as the exported graphs give them
        (BOOL key mask, INT32 segment ids), the outputs the floats' type unless `outputs` says."""
        return [
            trtp.AutoTuneCombination(
                ", ".join([code] * 3 + ["BOOL"] + [code] * 3 + ["INT32"] + [outputs or code]),
                "LINEAR",
                list(range(len(tactics(head_dim, named_dtype(dtype).itemsize)))),
            )
            for dtype, code in type_codes.items()
        ]

    # the op in one kernel
    describe_signature = signature(trtp.TensorDesc, tuple[trtp.TensorDesc])
    aot_signature = signature(trtp.TensorDesc, extra=(outputs_parameter, tactic_parameter))
    tune_signature = signature(trtp.TensorDesc, list[trtp.AutoTuneCombination], extra=(outputs_parameter,))

    def describe(*args, **kwargs):
        (q, *_), _, _ = split_arguments(describe_signature.bind(*args, **kwargs))
        checked_dtype(q)
        return q.like()

    def tune(*args, **kwargs):
        _, (_, _, head_dim), _ = split_arguments(tune_signature.bind(*args, **kwargs))
        return tactic_combinations(head_dim)

    def attention(split_keys: bool, signature_):
        def ahead_of_time(*args, **kwargs):
            bound = signature_.bind(*args, **kwargs)
            (q, k, _, _, _, k_vis, _, _), (_, _, head_dim), attributes = split_arguments(bound)
            dtype = checked_dtype(q)
            chosen = tactics(head_dim, named_dtype(dtype).itemsize)[bound.arguments["tactic"]]
            shapes = (list(t.shape_expr) for t in (q, k, k_vis))
            return to_tensorrt(attention_launch(dtype, *shapes, head_dim, attributes, chosen, split_keys))

        ahead_of_time.__signature__ = signature_
        return ahead_of_time

    describe.__signature__, tune.__signature__ = describe_signature, tune_signature
    trtp.register(contract.ID)(describe)
    trtp.autotune(contract.ID)(tune)
    trtp.aot_impl(contract.ID)(attention(False, aot_signature))

    # the op's shares, then their merge
    shares_describe_signature = signature(trtp.TensorDesc, tuple[trtp.TensorDesc, trtp.TensorDesc])

    def describe_shares(*args, **kwargs):
        (q, k, _, _, _, k_vis, _, _), _, attributes = split_arguments(shares_describe_signature.bind(*args, **kwargs))
        checked_dtype(q)
        shares, lse = shares_shapes(*(tuple(t.shape_expr) for t in (q, k, k_vis)), attributes)
        return trtp.from_shape_expr(shares, dtype=trt.float32), trtp.from_shape_expr(lse, dtype=trt.float32)

    def tune_shares(*args, **kwargs):
        _, (_, _, head_dim), _ = split_arguments(tune_signature.bind(*args, **kwargs))  # the op's inputs
        return tactic_combinations(head_dim, "FP32, FP32")

    describe_shares.__signature__, tune_shares.__signature__ = shares_describe_signature, tune_signature
    shares_id = f"{contract.DOMAIN}::{SHARES}"
    trtp.register(shares_id)(describe_shares)
    trtp.autotune(shares_id)(tune_shares)
    trtp.aot_impl(shares_id)(attention(True, signature(trtp.TensorDesc, extra=(outputs_parameter, tactic_parameter))))

    merge_describe_signature = merge_plugin_signature(trtp.TensorDesc, tuple[trtp.TensorDesc])
    merge_aot_signature = merge_plugin_signature(trtp.TensorDesc, extra=(outputs_parameter,))

    def describe_merge(*args, **kwargs):
        bound = merge_describe_signature.bind(*args, **kwargs)
        shares, args_ = bound.arguments["shares"], bound.arguments
        _, _, rows, queries, head_dim = tuple(shares.shape_expr)
        dtype = {name: code for code, name in dtype_names.items()}[args_["dtype"]]
        shape = (rows // args_["num_heads"], args_["num_heads"], queries, head_dim)
        return trtp.from_shape_expr(shape, dtype=dtype)

    def merge_ahead_of_time(*args, **kwargs):
        bound = merge_aot_signature.bind(*args, **kwargs)
        shape = list(bound.arguments["shares"].shape_expr)
        launch = merge_launch(bound.arguments["dtype"], shape, bound.arguments["head_dim"], merge_attributes(bound))
        return to_tensorrt(launch)

    describe_merge.__signature__ = merge_describe_signature
    merge_ahead_of_time.__signature__ = merge_aot_signature
    merge_id = f"{contract.DOMAIN}::{MERGE}"
    trtp.register(merge_id)(describe_merge)
    trtp.aot_impl(merge_id)(merge_ahead_of_time)
    _registered = True
