"""The DecomposedAttention op (`contract.py`) as one Triton kernel.

Flash-attention style: a program owns BLOCK_M rows, (query, head) pairs of one kv head's query heads (grouped-query
attention: the group reads each K/V tile once), and streams key segments in BLOCK_N tiles, never
materialising the logits:
  * text keys with the rotated queries `q`, causal by slot, optionally windowed;
  * context keys with the unrotated queries `q_vis` (all visible, or causal by slot when `CAUSAL_CONTEXT`): one
    pass over all of them (alpha), or one pass per context segment (sum), each pass loading only the tiles that
    hold a key of its segment (the int32 segment ids are read first: a pass reads its own keys and the ids).
Each segment keeps a running max, sum and accumulator; at the end
merge alpha: both are rescaled to their common max and normalised by the common sum: exactly one softmax over
             [context ; text] (the shared running max/sum, merged once instead of per tile);
merge sum:   each is normalised by its own sum and the outputs are added.
Logits and accumulation are fp32 whatever the input dtype.
Optionally writes the per-query log-sum-exp of each segment (S_V, S_T): sigmoid(S_V - S_T) is the
attention mass on the image.
Split keys (SPLIT_KEYS, a decode step): a third grid axis splits the text keys and the context keys into as many
shares as it has programs, one of each per program; each program writes each slot's (text; each context segment,
or all of them) normalized output and log-sum-exp, and `merge_shares_kernel` merges them (flash-decoding).

The same kernel runs under TRITON_INTERPRET=1 on CPU tensors (the tests), compiles to PTX for sm_80/sm_90
without a GPU (the TensorRT plugin's ahead-of-time implementation), and backs a torch.library op on CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton
import triton.language as tl

from ..artifacts import DTYPES
from . import contract
from .contract import Attributes

BLOCK_M = 16  # (query, head) rows a program unless the tiles say otherwise
MERGE_WARPS = 2  # merge_shares_kernel: one row of D values a program
INT_ARGS = (
    "num_heads",
    "group",
    "num_queries",
    "num_keys",
    "num_context",
    "stride_qb",
    "stride_qh",
    "stride_qt",
    "stride_kb",
    "stride_kh",
    "stride_kn",
    "stride_vb",
    "stride_vh",
    "stride_vn",
)
TRITON_TYPES = {d.name: d.short for d in DTYPES.values()}  # torch's names -> Triton's
LOG2E_: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _tile_update(m, l, acc, s, value, DOT_PRECISION: tl.constexpr):
    """One online-softmax step: fold logits `s` (BLOCK_M, BLOCK_N; -inf where masked) and their values."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
    p = tl.exp2((s - m_safe[:, None]) * LOG2E_)
    correction = tl.exp2((m - m_safe) * LOG2E_)
    l = l * correction + tl.sum(p, 1)
    acc = acc * correction[:, None] + tl.dot(
        p.to(value.dtype), value, out_dtype=tl.float32, input_precision=DOT_PRECISION
    )
    return m_new, l, acc


@triton.jit
def _segment(
    q,
    K,
    V,
    MASK,
    first_key,
    num_keys,
    stride_kn,
    mask_b,
    query_slot,
    key_slot0,
    scale: tl.constexpr,
    softcap: tl.constexpr,
    window: tl.constexpr,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SEGMENT: tl.constexpr,
):
    """Stream the keys [first_key, num_keys) of one segment (K, V at the kv head, MASK at the batch row: the keys
    whose mask is SEGMENT, or any non-zero one when SEGMENT is 0) through a fresh running state; returns it (max,
    sum, accumulator)."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(first_key, num_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < num_keys
        segment = tl.load(MASK + mask_b + offs_n, mask=in_range, other=0)
        if SEGMENT == 0:
            valid = in_range & (segment != 0)
        else:
            valid = in_range & (segment == SEGMENT)
        if tl.max(valid.to(tl.int32), 0) > 0:  # a tile without a key of this segment is never loaded
            k = tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :], mask=in_range[:, None], other=0.0)
            v = tl.load(V + offs_n[:, None] * stride_kn + offs_d[None, :], mask=in_range[:, None], other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32) * scale
            if SOFTCAP:
                s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
            visible = valid[None, :]
            if CAUSAL:
                distance = query_slot[:, None] - (key_slot0 + offs_n)[None, :]
                visible = visible & (distance >= 0) & ((window == 0) | (distance < window))
            s = tl.where(visible, s, float("-inf"))
            m, l, acc = _tile_update(m, l, acc, s, v, DOT_PRECISION)
    return m, l, acc


@triton.jit
def _normalized(l, acc):
    """A segment's softmax output: its accumulator over its sum (0 where the row saw no key)."""
    return acc / tl.where(l == 0.0, 1.0, l)[:, None]


@triton.jit
def _lse_union(m_a, l_a, m_b, l_b):
    """The running (max, sum) of two disjoint key sets as one."""
    m = tl.maximum(m_a, m_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    return m, l_a * tl.exp2((m_a - m_safe) * LOG2E_) + l_b * tl.exp2((m_b - m_safe) * LOG2E_)


@triton.jit
def _store_share(PARTIAL, PARTIAL_LSE, slot, SLOTS: tl.constexpr, out_row, num_rows, offs_d, rows,
                 HEAD_DIM: tl.constexpr, m, l, acc):  # fmt: skip
    """One slot's state over this program's share of the keys: its normalized output and log-sum-exp (fp32;
    PARTIAL (splits, SLOTS, B * Hq, T, D), PARTIAL_LSE (splits, SLOTS, B * Hq, T))."""
    row = (tl.program_id(2) * SLOTS + slot) * num_rows + out_row
    tl.store(PARTIAL + row[:, None] * HEAD_DIM + offs_d[None, :], _normalized(l, acc), mask=rows[:, None])
    tl.store(PARTIAL_LSE + row, m + tl.log(l), mask=rows)


@triton.jit
def _share(num_keys, BLOCK_N: tl.constexpr):
    """[start, end) of this program's share of `num_keys` keys, in whole tiles: the grid's third axis is the shares,
    set at launch (by shapes alone in TensorRT's)."""
    share = tl.cdiv(tl.cdiv(num_keys, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = tl.program_id(2) * share
    return start, tl.minimum(num_keys, start + share)


@triton.jit
def dattn_kernel(
    Q,
    K,
    V,
    KEY_MASK,
    QV,
    KV,
    VV,
    VIS_MASK,  # inputs, then int scalars, then outputs: TensorRT's AOT order
    num_heads,
    group,
    num_queries,
    num_keys,
    num_context,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    OUT,
    LSE,
    PARTIAL,
    PARTIAL_LSE,
    scale: tl.constexpr,
    softcap: tl.constexpr,
    window: tl.constexpr,  # per node: constants (AOT takes ints only)
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MERGE_SUM: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL_CONTEXT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,
    NUM_CONTEXTS: tl.constexpr,
    SLOTS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
):
    # a program's rows are (query, head) pairs of one kv head's group, the group's heads side by side: they read the
    # same K/V tiles, so a decode step (one query) fills a tile's rows with the group instead of padding
    pid_m, pid_bk = tl.program_id(0), tl.program_id(1)
    b, kv_head = pid_bk // (num_heads // group), pid_bk % (num_heads // group)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    query, h = offs_m // group, kv_head * group + offs_m % group
    offs_d = tl.arange(0, HEAD_DIM)
    q_offsets = b * stride_qb + h[:, None] * stride_qh + query[:, None] * stride_qt + offs_d[None, :]
    rows = offs_m < num_queries * group
    num_rows = tl.num_programs(1) * group * num_queries  # B * Hq * T
    out_row = (b * num_heads + h) * num_queries + query  # the row's place in (B, Hq, T)
    q = tl.load(Q + q_offsets, mask=rows[:, None], other=0.0)
    q_vis = tl.load(QV + q_offsets, mask=rows[:, None], other=0.0)
    if UPCAST:
        q, q_vis = q.to(tl.float32), q_vis.to(tl.float32)
    text_slot = num_keys - num_queries + query  # the queries are the last text slots
    text_start, text_end, context_start, context_end = 0, num_keys, 0, num_context
    if SPLIT_KEYS:  # this program takes one share of the text keys and one of the context keys
        text_start, text_end = _share(num_keys, BLOCK_N)
        context_start, context_end = _share(num_context, BLOCK_N)

    m_t, l_t, acc_t = _segment(
        q, K + b * stride_kb + kv_head * stride_kh, V + b * stride_kb + kv_head * stride_kh,
        KEY_MASK, text_start, text_end, stride_kn, b * num_keys, text_slot, 0, scale, softcap, window, offs_d,
        HEAD_DIM, BLOCK_M, BLOCK_N, SOFTCAP, CAUSAL, UPCAST, DOT_PRECISION, 0,
    )  # fmt: skip
    if SPLIT_KEYS:
        _store_share(PARTIAL, PARTIAL_LSE, 0, SLOTS, out_row, num_rows, offs_d, rows, HEAD_DIM,
                     m_t, l_t, acc_t)  # fmt: skip
    # context keys: slots [0, V) before the text when causal, so the queries sit at V + their text slot
    K_context, V_context = KV + b * stride_vb + kv_head * stride_vh, VV + b * stride_vb + kv_head * stride_vh
    if MERGE_SUM:  # one softmax per segment, added
        out = _normalized(l_t, acc_t)
        m_v = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_v = tl.zeros([BLOCK_M], tl.float32)
        for segment in tl.static_range(1, NUM_CONTEXTS + 1):
            m_s, l_s, acc_s = _segment(
                q_vis, K_context, V_context, VIS_MASK, context_start, context_end, stride_vn, b * num_context,
                num_context + text_slot, 0, scale, softcap, window, offs_d, HEAD_DIM, BLOCK_M, BLOCK_N, SOFTCAP,
                CAUSAL_CONTEXT, UPCAST, DOT_PRECISION, segment,
            )  # fmt: skip
            if SPLIT_KEYS:
                _store_share(PARTIAL, PARTIAL_LSE, segment, SLOTS, out_row, num_rows, offs_d, rows,
                             HEAD_DIM, m_s, l_s, acc_s)  # fmt: skip
            out += _normalized(l_s, acc_s)
            m_v, l_v = _lse_union(m_v, l_v, m_s, l_s)
    else:  # one softmax over [context ; text]: rescale both running states to their common max
        m_v, l_v, acc_v = _segment(
            q_vis, K_context, V_context, VIS_MASK, context_start, context_end, stride_vn, b * num_context,
            num_context + text_slot, 0, scale, softcap, window, offs_d, HEAD_DIM, BLOCK_M, BLOCK_N, SOFTCAP,
            CAUSAL_CONTEXT, UPCAST, DOT_PRECISION, 0,
        )  # fmt: skip
        if SPLIT_KEYS:
            _store_share(PARTIAL, PARTIAL_LSE, 1, SLOTS, out_row, num_rows, offs_d, rows, HEAD_DIM,
                         m_v, l_v, acc_v)  # fmt: skip
        m = tl.maximum(m_v, m_t)
        m = tl.where(m == float("-inf"), 0.0, m)
        w_v, w_t = tl.exp2((m_v - m) * LOG2E_), tl.exp2((m_t - m) * LOG2E_)
        total = l_v * w_v + l_t * w_t
        out = (acc_v * w_v[:, None] + acc_t * w_t[:, None]) / tl.where(total == 0.0, 1.0, total)[:, None]
    if not SPLIT_KEYS:  # with split keys, `merge_shares_kernel` merges the shares
        tl.store(OUT + q_offsets, out.to(OUT.dtype.element_ty), mask=rows[:, None])
    if WRITE_LSE:  # LSE: (2, B, Hq, T) fp32, S_V (all context keys) then S_T; -inf for a segment with nothing visible
        tl.store(LSE + out_row, m_v + tl.log(l_v), mask=rows)
        tl.store(LSE + num_rows + out_row, m_t + tl.log(l_t), mask=rows)


def launch_grid(q_shape, k_shape, cdiv=lambda a, b: -(-a // b), block_m: int = BLOCK_M):
    """(grid_x, grid_y): blocks of the (query, head) rows of one kv head's group x (batch * kv heads). `cdiv` works
    on ints or TensorRT shape expressions."""
    batch, heads, queries, _ = q_shape
    kv_heads = k_shape[1]
    return cdiv(queries * heads, block_m * kv_heads), batch * kv_heads


def at_least(a, b):
    """max(a, b) of ints, or of TensorRT's shape expressions (which have +, -, *, // and <, but no max)."""
    return a + (b - a) * (a < b)


def at_most(a, b):
    """min(a, b), as `at_least`."""
    return a - (a - b) * (b < a)


def key_splits(num_queries, num_keys):
    """The shares a decode step's keys (text and context) are split into (flash-decoding): unsplit, one program per
    kv head streams every key while most of the GPU's multiprocessors wait. Shares of about 1024 keys, at most 32:
    the fastest `bench/kernel_blocks.py --splits` measured on an H200 from 2k to 64k context tokens (more shares
    cost more in the merge than they save). A prefill (more queries than a program's rows) is not split. Ints, or
    TensorRT's shape expressions (the plugin's grid is computed from the shapes at each launch)."""
    decode = num_queries < BLOCK_M + 1
    return 1 + decode * (at_most(at_least(num_keys // 1024, 1), 32) - 1)


@triton.jit
def merge_shares_kernel(PARTIAL, PARTIAL_LSE, num_rows, splits, OUT, SLOTS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        MERGE_SUM: tl.constexpr):  # fmt: skip
    """One output row (of B * Hq * T) from the split programs' shares (`_store_share`): each slot's shares weighted
    by their log-sum-exps, then the slots added (sum merge) or, for alpha, all shares of both slots weighted alike
    (one softmax over all keys). A share or slot that saw no key (log-sum-exp -inf) weighs nothing."""
    row = tl.program_id(0)
    offs_d = tl.arange(0, HEAD_DIM)
    out = tl.zeros([HEAD_DIM], tl.float32)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for slot in tl.static_range(SLOTS):
        for share in range(splits):
            index = (share * SLOTS + slot) * num_rows + row
            lse = tl.load(PARTIAL_LSE + index + tl.arange(0, 1))
            m_new = tl.maximum(m, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            keep, weight = tl.exp2((m - m_safe) * LOG2E_), tl.exp2((lse - m_safe) * LOG2E_)
            l = l * keep + weight
            acc = acc * keep + weight * tl.load(PARTIAL + index * HEAD_DIM + offs_d)
            m = m_new
        if MERGE_SUM:
            out += acc / tl.where(l == 0.0, 1.0, l)
            m = tl.full([1], float("-inf"), tl.float32)
            l = tl.zeros([1], tl.float32)
            acc = tl.zeros([HEAD_DIM], tl.float32)
    if not MERGE_SUM:
        out = acc / tl.where(l == 0.0, 1.0, l)
    tl.store(OUT + row * HEAD_DIM + offs_d, out.to(OUT.dtype.element_ty))


def merge_shares(partial, partial_lse, out, merge_sum: bool) -> None:
    """`out` (contiguous B, Hq, T, D) from the shares: PARTIAL (splits, SLOTS, B * Hq, T, D) and its log-sum-exps."""
    splits, slots = partial.shape[:2]
    num_rows = out.numel() // out.shape[-1]
    merge_shares_kernel[(num_rows,)](partial, partial_lse, num_rows, splits, out, SLOTS=slots,
                                     HEAD_DIM=out.shape[-1], MERGE_SUM=merge_sum, num_warps=MERGE_WARPS)  # fmt: skip


def int_arguments(q_shape, k_shape, k_vis_shape) -> list:
    """The kernel's scalar arguments (INT_ARGS order) for contiguous inputs, from shapes (ints or expressions)."""
    batch, heads, queries, head_dim = q_shape
    _, kv_heads, keys, _ = k_shape
    num_context = k_vis_shape[2]
    return [heads, heads // kv_heads, queries, keys, num_context,
            heads * queries * head_dim, queries * head_dim, head_dim,
            kv_heads * keys * head_dim, keys * head_dim, head_dim,
            kv_heads * num_context * head_dim, num_context * head_dim, head_dim]  # fmt: skip


def constants(attributes: Attributes, head_dim: int, block_m: int, block_n: int, **flags) -> dict:
    """The kernel's compile-time parameters for one node's attributes (AOT plugins take only ints at run time)."""
    return dict(
        scale=float(attributes.scale),
        softcap=float(attributes.softcap),
        window=int(attributes.window),
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        MERGE_SUM=attributes.merge == "sum",
        SOFTCAP=attributes.softcap > 0,
        CAUSAL_CONTEXT=bool(attributes.causal_context),
        CAUSAL=bool(attributes.causal),
        NUM_CONTEXTS=attributes.num_contexts,
        SLOTS=attributes.slots,
        **flags,
    )


def dot_precision(dtype: str, tf32: bool = False) -> str | None:
    """tl.dot's input precision for tiles of `dtype`: fp32 tiles multiplied in full fp32 ("ieee") unless TF32 is
    allowed, as PyTorch multiplies fp32 (torch.get_float32_matmul_precision()). Triton's own default on a GPU is
    TF32 (10 mantissa bits): fp32 attention up to 3.7e-3 off the reference on an H200, within 1e-4 in full fp32.
    Half-precision tiles: Triton's default (the precision names only fp32 inputs)."""
    return "ieee" if dtype == "float32" and not tf32 else None


@dataclass(frozen=True)
class Tiles:
    """A program's tile shape and warps: they change the kernel's speed, never its result."""

    block_m: int  # (query, head) rows a program
    block_n: int  # keys a tile
    num_warps: int
    num_stages: int = 3


def tiles(num_queries: int, head_dim: int, element_bytes: int = 2) -> Tiles:
    """The tiles `launch` takes on a GPU: the fastest bench/kernel_blocks.py measured on an H200 (fp16, 16k and 64k
    context tokens; docs/benchmarks.md). A decode step streams the context through wide key
    tiles; a prefill of head dim 128 takes 64 queries a program, of 256 (registers) 16. fp32 tiles hold half the
    keys, the same bytes: fp16's shapes in fp32 asked an H200 for up to 288 KiB of shared memory, over its 227 KiB."""
    per_key = max(1, element_bytes // 2)  # a key's bytes over fp16's
    if num_queries <= BLOCK_M:
        return Tiles(BLOCK_M, (256 if head_dim <= 128 else 128) // per_key, 8)
    if head_dim <= 128:
        return Tiles(64, 128 // per_key, 4)
    return Tiles(BLOCK_M, 64 // per_key, 4)


def launch(
    q,
    k,
    v,
    key_mask,
    q_vis,
    k_vis,
    v_vis,
    context_mask,
    attributes: Attributes,
    *,
    return_lse: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    splits: int | None = None,
):
    """Run the kernel (on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1). Same result as the contract's
    reference; with `return_lse`, also (S_V, S_T), each (B, Hq, T) fp32. The tile sizes, warps, pipeline stages and
    the context keys' split into shares change the speed only (by default `tiles` and `key_splits`)."""
    import torch

    batch, heads, queries, head_dim = q.shape
    splits = 1 if return_lse else splits or key_splits(queries, k.shape[2] + k_vis.shape[2])
    chosen = tiles(queries, head_dim, q.element_size())
    block_m, block_n = block_m or chosen.block_m, block_n or chosen.block_n
    num_warps = num_warps or chosen.num_warps
    contract.check_shapes(heads, k.shape[1], head_dim)
    q, k, v, q_vis, k_vis, v_vis = (t.contiguous() for t in (q, k, v, q_vis, k_vis, v_vis))
    key_mask, context_mask = key_mask.to(torch.int8).contiguous(), context_mask.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    lse = torch.empty((2, batch, heads, queries), dtype=torch.float32, device=q.device)
    # Triton's CPU interpreter multiplies bf16 tiles wrongly in tl.dot (loads are exact): there, and only there,
    # bf16 tiles are upcast to fp32 first (exact; accumulation is fp32 either way)
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    precision = dot_precision(str(q.dtype).removeprefix("torch."), torch.get_float32_matmul_precision() != "highest")
    fixed = constants(attributes, head_dim, block_m, block_n, WRITE_LSE=return_lse, UPCAST=upcast,
                      SPLIT_KEYS=splits > 1, DOT_PRECISION=precision)  # fmt: skip
    partial = partial_lse = None
    if splits > 1:
        shape = (splits, attributes.slots, batch * heads, queries, head_dim)
        partial = torch.empty(shape, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(partial.shape[:-1], dtype=torch.float32, device=q.device)
    dattn_kernel[(*launch_grid(q.shape, k.shape, block_m=block_m), splits)](
        q,
        k,
        v,
        key_mask,
        q_vis,
        k_vis,
        v_vis,
        context_mask,
        *int_arguments(q.shape, k.shape, k_vis.shape),
        out,
        lse,
        partial,
        partial_lse,
        **fixed,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        merge_shares(partial, partial_lse, out, attributes.merge == "sum")
    return (out, lse[0], lse[1]) if return_lse else out
