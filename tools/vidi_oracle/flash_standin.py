"""A pure-PyTorch stand-in for flash-attn 2.6 (CPU oracle only), per flash-attn's documented masking rule:
causal masks are aligned to the bottom-right; window_size=(left, right) lets query i see key j when
i + Sk - Sq - left <= j <= i + Sk - Sq + right (-1: unbounded); softcap: s = softcap * tanh(s / softcap)."""

import sys
import types

import torch

__version__ = "2.6.3"


def _mask(sq, sk, causal, window, device):
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    left, right = window
    if causal:
        right = 0
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        allowed &= j <= i + right
    if left >= 0:
        allowed &= j >= i - left
    return allowed


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    s = qf @ kf.transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~_mask(sq, sk, causal, window_size, q.device), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2).to(q.dtype)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    **kw,
):
    out = torch.empty_like(q)
    for n in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = cu_seqlens_q[n], cu_seqlens_q[n + 1], cu_seqlens_k[n], cu_seqlens_k[n + 1]
        out[qs:qe] = flash_attn_func(
            q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], 0.0, softmax_scale, causal, window_size, softcap
        )[0]
    return out


def index_first_axis(x, indices):
    return x[indices]


def unpad_input(hidden, mask):
    seqlens = mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    return hidden.flatten(0, 1)[indices], indices, cu, int(seqlens.max())


def pad_input(hidden, indices, batch, seqlen):
    out = hidden.new_zeros(batch * seqlen, *hidden.shape[1:])
    out[indices] = hidden
    return out.unflatten(0, (batch, seqlen))


def loop_reference(q, k, v, scale, causal, window, softcap):
    """float64 loop of the documented rule, to check the stand-in against."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    left, right = window
    if causal:
        right = 0
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                c = i + sk - sq
                keys = [j for j in range(sk) if (right < 0 or j <= c + right) and (left < 0 or j >= c - left)]
                if not keys:
                    continue
                s = torch.tensor(
                    [float(q[bi, i, hi].double() @ k[bi, j, hi // (h // hk)].double()) * scale for j in keys],
                    dtype=torch.float64,
                )
                if softcap:
                    s = torch.tanh(s / softcap) * softcap
                p = torch.softmax(s, 0)
                out[bi, i, hi] = sum(p[n] * v[bi, j, hi // (h // hk)].double() for n, j in enumerate(keys))
    return out


def install():
    flash = types.ModuleType("flash_attn")
    flash.__version__ = __version__
    flash.flash_attn_func, flash.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.index_first_axis, padding.unpad_input, padding.pad_input = index_first_axis, unpad_input, pad_input
    flash.bert_padding = padding
    sys.modules["flash_attn"], sys.modules["flash_attn.bert_padding"] = flash, padding


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for causal, window, softcap, sq, sk in [
        (True, (-1, -1), 0.0, 9, 9),
        (True, (3, 3), 0.0, 9, 9),
        (True, (3, 3), 5.0, 4, 9),
        (False, (-1, -1), 0.0, 5, 7),
        (False, (-1, -1), 2.0, 1, 7),
        (True, (2, 2), 0.0, 1, 9),
    ]:
        q = torch.randn(2, sq, 4, 8, generator=g)
        k = torch.randn(2, sk, 2, 8, generator=g)
        v = torch.randn(2, sk, 2, 8, generator=g)
        got = flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal, window_size=window, softcap=softcap)
        ref = loop_reference(q, k, v, 0.3, causal, window, softcap)
        worst = max(worst, float((got.double() - ref).abs().max()))
    print(f"stand-in vs float64 loop of flash-attn's rule: max abs error {worst:.2e}")
