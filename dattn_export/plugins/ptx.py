"""The DecomposedAttention kernels compiled to PTX without a GPU, as TensorRT's ahead-of-time plugins ship them: for
the building GPU's architecture, at the PTX version deployment drivers load, each entry taking exactly the pointers
and integers TensorRT passes (inputs, integers, outputs)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton

from .contract import Attributes
from .triton_kernel import (
    INT_ARGS,
    MERGE_WARPS,
    TRITON_TYPES,
    Tiles,
    constants,
    dattn_kernel,
    dot_precision,
    merge_shares_kernel,
)

PTX_VERSION = 84  # PTX ISA 8.4: what the drivers of CUDA 12.4 and later load (Triton's own default needs newer)
SCRATCH_PARAMETERS = 2  # Triton (>= 3.3) ends every kernel's parameters with its global and profile scratch pointers


@dataclass(frozen=True)
class Compiled:
    """A kernel compiled for a GPU without one: its entry's name, its PTX, and what a launch of it needs."""

    name: str
    ptx: str
    num_warps: int
    shared: int  # bytes of shared memory a program
    parameter_count: int  # the entry's parameters: the pointers and integers a launch passes, in order


def gpu_arch() -> int:
    """The visible GPU's architecture (90 for an H100 or H200), what TensorRT builds for; 90 without a GPU."""
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return 10 * major + minor
    return 90


def compile_for_gpu(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3,
                    arch: int | None = None, ptx_version: int = PTX_VERSION) -> Compiled:  # fmt: skip
    """`fn` compiled to PTX for sm_`arch` (default: the visible GPU's), its entry taking exactly the signature's
    pointers and integers in order, as TensorRT's ahead-of-time plugins launch a kernel (inputs, integers, outputs).
    Triton's trailing scratch pointers are dropped from the entry: this kernel uses neither (their sizes are 0 and no
    instruction reads them), and TensorRT passes no such arguments. Under Triton's interpreter (TRITON_INTERPRET=1)
    nothing can be compiled: the result names the kernel and its parameters with no PTX, for a launch that is
    interpreted from the kernel itself (the GPU check's dry run); tests/test_kernels.py compiles the PTX in a
    process of its own."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return Compiled(fn.__name__, "", num_warps, 0, len(signature))
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs)
    options = dict(num_warps=num_warps, num_stages=num_stages, ptx_version=ptx_version)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch or gpu_arch(), 32), options=options)
    metadata, ptx = compiled.metadata, compiled.asm["ptx"]
    head, rest = ptx.split(f".entry {metadata.name}(", 1)
    declared, body = rest.split(")", 1)
    lines = [line for line in declared.splitlines() if line.strip()]
    wanted = len(signature)
    if len(lines) == wanted + SCRATCH_PARAMETERS:
        unused = lines[wanted:]
        names = [line.strip().rstrip(",").split()[-1] for line in unused]
        if metadata.global_scratch_size or metadata.profile_scratch_size or any(n in body for n in names):
            raise RuntimeError(f"{metadata.name}: Triton's scratch parameters are used: TensorRT cannot launch it")
        lines = lines[:wanted]
        lines[-1] = lines[-1].rstrip(",")
        ptx = f"{head}.entry {metadata.name}(\n" + "\n".join(lines) + "\n)" + body
    elif len(lines) != wanted:
        raise RuntimeError(f"{metadata.name}: {len(lines)} parameters in its PTX, {wanted} expected")
    return Compiled(metadata.name, ptx, metadata.num_warps, metadata.shared, wanted)


def attention_signature(dtype: str, split_keys: bool) -> dict:
    """The attention kernel's pointers and integers as TensorRT passes them: the 8 inputs, INT_ARGS, then the output
    (or with `split_keys` the shares and their log-sum-exps, fp32)."""
    element = TRITON_TYPES[dtype]
    signature = dict(Q=f"*{element}", K=f"*{element}", V=f"*{element}", KEY_MASK="*i8", QV=f"*{element}",
                     KV=f"*{element}", VV=f"*{element}", VIS_MASK="*i32")  # fmt: skip
    signature |= dict.fromkeys(INT_ARGS, "i32")
    return signature | (dict(PARTIAL="*fp32", PARTIAL_LSE="*fp32") if split_keys else dict(OUT=f"*{element}"))


def attention_constants(dtype: str, head_dim: int, attributes: Attributes, chosen: Tiles, split_keys: bool) -> dict:
    """The attention kernel's compile-time parameters for an ahead-of-time launch: the pointers it does not take
    compiled away (the LSE's; the output or the shares)."""
    away = dict(LSE=None, **(dict(OUT=None) if split_keys else dict(PARTIAL=None, PARTIAL_LSE=None)))
    return away | constants(attributes, head_dim, chosen.block_m, chosen.block_n, WRITE_LSE=False, UPCAST=False,
                            SPLIT_KEYS=split_keys, DOT_PRECISION=dot_precision(dtype))  # fmt: skip


def merge_signature(dtype: str) -> dict:
    return dict(PARTIAL="*fp32", PARTIAL_LSE="*fp32", num_rows="i32", splits="i32", OUT=f"*{TRITON_TYPES[dtype]}")


def merge_constants(head_dim: int, attributes: Attributes) -> dict:
    return dict(SLOTS=attributes.slots, HEAD_DIM=head_dim, MERGE_SUM=attributes.merge == "sum")


def compile_attention(dtype: str, head_dim: int, attributes: Attributes, chosen: Tiles, split_keys: bool = False,
                      arch: int | None = None, ptx_version: int = PTX_VERSION) -> Compiled:  # fmt: skip
    """The attention kernel for one node's attributes and one tile shape, as the TensorRT plugins ship it."""
    return compile_for_gpu(dattn_kernel, attention_signature(dtype, split_keys),
                           attention_constants(dtype, head_dim, attributes, chosen, split_keys), chosen.num_warps,
                           chosen.num_stages, arch, ptx_version)  # fmt: skip


def compile_merge(dtype: str, head_dim: int, attributes: Attributes, arch: int | None = None,
                  ptx_version: int = PTX_VERSION) -> Compiled:  # fmt: skip
    """The shares' merge for one node's attributes, as the TensorRT plugin ships it."""
    return compile_for_gpu(merge_shares_kernel, merge_signature(dtype), merge_constants(head_dim, attributes),
                           MERGE_WARPS, 1, arch, ptx_version)  # fmt: skip
