"""The Triton kernel of DecomposedAttention against the reference op, run by Triton's CPU interpreter
(TRITON_INTERPRET=1, set by conftest.py on machines without a GPU).

Tolerances per dtype (max abs error, outputs O(1)): fp32 1e-4; fp16 2e-3; bf16 2e-2 (8 mantissa bits).
"""

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from helpers.checks import context_segments  # noqa: E402

from dattn_export.plugins import contract  # noqa: E402
from dattn_export.plugins.contract import Attributes  # noqa: E402
from dattn_export.plugins.triton_kernel import launch  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # interpreted on CPU, compiled on a GPU


def problem(dtype, batch, heads, kv_heads, queries, past, visual, dim, seed):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE, dtype)
    keys = past + queries
    key_mask = torch.ones(batch, keys, dtype=torch.bool)
    key_mask[0, : min(2, past)] = False  # left padding
    context_mask = torch.ones(batch, visual, dtype=torch.bool)
    if visual > 4:
        context_mask[-1, -3:] = False
    return (
        rand(batch, heads, queries, dim),
        rand(batch, kv_heads, keys, dim),
        rand(batch, kv_heads, keys, dim),
        key_mask.to(DEVICE),
        rand(batch, heads, queries, dim),
        rand(batch, kv_heads, visual, dim),
        rand(batch, kv_heads, visual, dim),
        context_mask.to(DEVICE),
    )


# a covering grid: every value of every axis appears, combined pairwise by rotation rather than in full product
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128, 256]
GQA = [(8, 8), (8, 2), (8, 1)]  # ratios 1, 4, 8
SHAPES = [  # (queries, past, visual): prefill, decode, |V| 0 / 1 / odd / large, odd text, with past
    (17, 0, 0),
    (1, 23, 1),
    (5, 3, 37),
    (1, 40, 300),
    (33, 0, 19),
    (7, 12, 64),
]
CASES = [
    (dtype, HEAD_DIMS[i % 3], GQA[(i // 3) % 3], shape, softcap, merge)
    for i, (dtype, shape, (softcap, merge)) in enumerate(
        itertools.product(DTYPES, SHAPES, [(None, "alpha"), (2.0, "sum")])
    )
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, dim, heads, shape, softcap, merge", CASES)
def test_kernel_matches_reference(dtype, dim, heads, shape, softcap, merge):
    (q_heads, kv_heads), (queries, past, visual) = heads, shape
    args = problem(dtype, 2, q_heads, kv_heads, queries, past, visual, dim, seed=dim + queries + visual)
    attributes = Attributes.from_reference(
        scale=dim**-0.5, softcap=softcap, merge=merge, window=6 if past > 10 else None
    )
    got = launch(*args, attributes)
    expected = contract.reference(args, attributes)
    assert got.dtype == dtype and got.shape == expected.shape
    error = (got.float() - expected.float()).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max abs error {error:.2e}"


# (queries, past, segment lengths): frames + audio, and three segments; decode and prefill; a tile shared by two
# segments (lengths not multiples of the 16-key tile) and one segment spanning many tiles
SEGMENTED = [(1, 30, [40, 9]), (9, 4, [5, 70]), (1, 12, [17, 3, 33]), (20, 0, [64, 16, 2])]
SEGMENTED_CASES = [
    (dtype, shape, merge, shuffled)
    for i, (dtype, shape) in enumerate(itertools.product(DTYPES, SEGMENTED))
    for merge, shuffled in [("sum", i % 2 == 1), ("alpha", False)]
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, shape, merge, shuffled", SEGMENTED_CASES)
def test_kernel_with_context_segments(dtype, shape, merge, shuffled):
    """Two and three context segments (num_contexts), with a row that lacks segment 2 and padded keys; the segment
    of each key given by the mask, contiguous or shuffled."""
    queries, past, lengths = shape
    args = list(problem(dtype, 2, 8, 2, queries, past, sum(lengths), 64, seed=queries + sum(lengths)))
    args[7] = context_segments(2, lengths, torch.Generator().manual_seed(3) if shuffled else None).to(DEVICE)
    attributes = Attributes.from_reference(scale=0.125, softcap=30.0, merge=merge, num_contexts=len(lengths))
    got = launch(*args, attributes)
    expected = contract.reference(tuple(args), attributes)
    error = (got.float() - expected.float()).abs().max().item()
    magnitude = max(1.0, expected.float().abs().max().item())  # N + 1 softmax outputs added: outputs O(N)
    assert error <= TOLERANCE[dtype] * magnitude, f"max abs error {error:.2e} at outputs up to {magnitude:.1f}"
    if merge == "sum":  # not what one softmax over all context keys gives
        one_segment = contract.reference(tuple(args[:7]) + (args[7] > 0,), Attributes(0.125, 30.0, merge="sum"))
        assert (expected.float() - one_segment.float()).abs().max() > 10 * TOLERANCE[dtype]


# (dtype, queries, past, segment lengths, merge): decode steps and a short prefill; one, two and three segments
SPLIT_CASES = [
    (torch.float32, 1, 23, [70], "alpha"),
    (torch.float16, 1, 40, [150, 150], "sum"),
    (torch.float32, 3, 5, [37], "sum"),
    (torch.float16, 1, 30, [16, 16, 17], "sum"),
    (torch.float32, 1, 4, [0], "alpha"),
]


@pytest.mark.parametrize("dtype, queries, past, lengths, merge", SPLIT_CASES)
def test_split_keys_merge_to_the_reference(monkeypatch, dtype, queries, past, lengths, merge):
    """Split keys (flash-decoding, a decode step's default): each program takes one share of the text keys and one of
    the context keys; merged, the reference's output. The shares partition the keys: a share past the text holds no
    text key, and the shares' log-sum-exps add up to the unsplit kernel's S_T (and S_V for alpha)."""
    from dattn_export.plugins import triton_kernel

    args = list(problem(dtype, 2, 8, 2, queries, past, sum(lengths), 64, seed=sum(lengths)))
    args[7] = context_segments(2, lengths, None).to(DEVICE) if merge == "sum" else args[7]
    attributes = Attributes(0.125, softcap=30.0, merge=merge, num_contexts=len(lengths) if merge == "sum" else 1)
    shares = []
    merge_shares = triton_kernel.merge_shares
    monkeypatch.setattr(triton_kernel, "merge_shares", lambda *a: shares.append(a) or merge_shares(*a))
    got = launch(*args, attributes, splits=5, block_n=16)
    expected = contract.reference(tuple(args), attributes)
    magnitude = max(1.0, expected.float().abs().max().item())
    assert (got.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * magnitude
    ((partial, partial_lse, _, _),) = shares
    assert partial.shape[:2] == (5, len(lengths) + 1 if merge == "sum" else 2)
    text_shares = -(-(queries + past) // 16)  # shares of one 16-key tile each
    # the last query sees every text key: each share within the text holds some, each past it none
    assert (
        torch.isfinite(partial_lse[:text_shares, 0, :, -1]).all() and torch.isneginf(partial_lse[text_shares:, 0]).all()
    )
    _, lse_v, lse_t = launch(*args, attributes, return_lse=True)
    torch.testing.assert_close(torch.logsumexp(partial_lse[:, 0], 0).view(lse_t.shape), lse_t, atol=1e-4, rtol=0)
    if merge == "alpha":
        split_v = torch.logsumexp(partial_lse[:, 1], 0).view(lse_v.shape)
        torch.testing.assert_close(split_v, lse_v, atol=1e-4, rtol=0)


@pytest.mark.parametrize("merge_sum", [False, True])
def test_merging_shares_is_the_log_sum_exp_weighting(merge_sum):
    """The merge kernel against the formula written out: each slot's shares weighted by exp(lse - logsumexp), the
    slots added (sum) or weighted by the softmax of their totals (alpha); shares and a whole slot that saw no key
    (-inf) weigh nothing."""
    from dattn_export.plugins.triton_kernel import merge_shares

    generator = torch.Generator().manual_seed(11)
    partial = torch.randn(6, 3, 4, 2, 32, generator=generator)  # splits, slots, B * Hq, T, D
    partial_lse = torch.randn(partial.shape[:-1], generator=generator) * 4
    partial_lse[1:, 0] = float("-inf")  # the text slot: the first share alone
    partial_lse[:, 2, 1] = float("-inf")  # one row's last slot saw no key
    partial_lse[3, 1] = float("-inf")
    out = torch.empty(2, 2, 2, 32)
    merge_shares(partial.to(DEVICE), partial_lse.to(DEVICE), out := out.to(DEVICE), merge_sum)
    total = torch.logsumexp(partial_lse, 0)
    slots = (torch.exp(partial_lse - total).nan_to_num(0.0)[..., None] * partial).sum(0)
    weights = torch.ones_like(total) if merge_sum else torch.softmax(total, 0)
    expected = (weights[..., None] * slots).sum(0).view(out.shape)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_kernel_without_causality():
    """causal=False: MMCA's attention within an image (every real key visible, no visual segment)."""
    args = problem(torch.float32, 3, 4, 2, 16, 0, 0, 32, seed=8)
    attributes = Attributes(0.2, merge="sum", causal=0)
    torch.testing.assert_close(launch(*args, attributes), contract.reference(args, attributes), atol=1e-4, rtol=0)


@pytest.mark.parametrize("merge", ["alpha", "sum"])
def test_kernel_causal_visual_and_lse(merge):
    args = problem(torch.float32, 2, 4, 2, 6, 3, 21, 32, seed=5)
    attributes = Attributes(0.2, merge=merge, causal_context=1, window=8)
    out, lse_v, lse_t = launch(*args, attributes, return_lse=True)
    torch.testing.assert_close(out, contract.reference(args, attributes), atol=1e-4, rtol=0)
    # the LSEs are the log-sum-exp of each segment's logits, computed literally
    q, k, _, key_mask, q_vis, k_vis, _, context_mask = args
    slots = torch.arange(21 + 9, device=DEVICE)
    query_slots = slots[-6:]
    for lse, query, keys, key_slots, mask in (
        (lse_v, q_vis, k_vis, slots[:21], context_mask),
        (lse_t, q, k, slots[21:], key_mask),
    ):
        logits = query @ keys.repeat_interleave(2, 1).transpose(-1, -2) * 0.2
        distance = query_slots[:, None] - key_slots[None, :]
        visible = (distance >= 0) & (distance < 8) & mask[:, None, None, :]
        expected = torch.logsumexp(logits.masked_fill(~visible, float("-inf")), dim=-1)
        torch.testing.assert_close(lse, expected, atol=1e-4, rtol=0)


PTX_SCRIPT = """
import json, sys
from dattn_export.plugins.contract import Attributes
from dattn_export.plugins.tensorrt_plugin import tactics
from dattn_export.plugins.ptx import compile_attention, compile_merge
compiled = {}
for arch, dtype, merge, head_dim in json.loads(sys.argv[1]):
    attributes = Attributes(head_dim**-0.5, softcap=50.0, window=4096, merge=merge,
                            num_contexts=2 if merge == "sum" else 1)
    for tactic, tiles in enumerate(tactics(head_dim, 4 if dtype == "float32" else 2)):
        for split in (True, False) if tactic == 0 else (True,):  # what `trt` builds; the one-kernel plugin once
            kernel = compile_attention(dtype, head_dim, attributes, tiles, split, arch=arch)
            compiled[f"{arch} {dtype} {merge} {head_dim}|{tactic} {split}"] = kernel.__dict__
    kernel = compile_merge(dtype, head_dim, attributes, arch=arch)
    compiled[f"{arch} {dtype} {merge} {head_dim}|merge"] = kernel.__dict__
print(json.dumps(compiled))
"""
# every tactic at both head-dim classes; both merges and both architectures in half precision; fp32 (no tensor cores)
PTX_CASES = [(90, "float16", "alpha", 128), (90, "float16", "sum", 256), (80, "bfloat16", "sum", 128),
             (90, "float32", "alpha", 128)]  # fmt: skip


@pytest.fixture(scope="module")
def compiled_ptx():
    """Every PTX_CASES kernel, compiled in one child process: under TRITON_INTERPRET the kernel is interpreted, not
    compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", PTX_SCRIPT, json.dumps(PTX_CASES)], capture_output=True, text=True,
                            env=env, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def entry_parameters(kernel: dict) -> list[str]:
    entry = kernel["ptx"].split(f".entry {kernel['name']}(")[1].split(")")[0]
    return [line.split()[1] for line in entry.splitlines() if ".param" in line]


@pytest.mark.slow
@pytest.mark.parametrize("arch, dtype, merge, head_dim", PTX_CASES)
def test_every_tactic_compiles_to_ptx_without_a_gpu(compiled_ptx, arch, dtype, merge, head_dim):
    """What the TensorRT plugins' ahead-of-time implementations ship, for every tactic: PTX for the target
    architecture at the PTX version deployment drivers load (CUDA 12.4's and later), its entry taking exactly what
    TensorRT passes (input pointers, the integers, output pointers; Triton's scratch pointers dropped)."""
    from dattn_export.plugins.tensorrt_plugin import tactics

    case = f"{arch} {dtype} {merge} {head_dim}"
    kernels = {key.split("|")[1]: value for key, value in compiled_ptx.items() if key.split("|")[0] == case}
    assert len(kernels) == len(tactics(head_dim, 4 if dtype == "float32" else 2)) + 2
    for key, kernel in kernels.items():
        ptx = kernel["ptx"]
        assert f".target sm_{arch}" in ptx and f".entry {kernel['name']}(" in ptx and ".version 8.4" in ptx, key
        params = entry_parameters(kernel)
        assert len(params) == kernel["parameter_count"], key
        if key == "merge":  # the shares, their log-sum-exps, rows and shares, the output
            assert params == [".u64", ".u64", ".u32", ".u32", ".u64"]
            continue
        outputs = 2 if key.endswith("True") else 1  # the shares and their log-sum-exps, or the op's output
        assert params == [".u64"] * 8 + [".u32"] * 14 + [".u64"] * outputs, key
        tensor_core = [line for line in ptx.splitlines() if "mma.sync" in line or "wgmma" in line]
        if dtype == "float32":  # multiplied in fp32, as PyTorch multiplies fp32 by default: not in TF32 on tensor cores
            assert not tensor_core and "tf32" not in ptx, key
        else:
            assert tensor_core, key
