"""`torch.ops.dattn.decomposed_attention`: the DecomposedAttention op for PyTorch users.

On CUDA tensors it runs the Triton kernel (O(|V|) attention, no logits materialised); elsewhere the reference
implementation. Arguments as `attention.dattn_op`, with soft-cap 0 and window 0 meaning "none".
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import dattn_op


@torch.library.custom_op("dattn::decomposed_attention", mutates_args=())
def decomposed_attention(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, q_vis: Tensor, k_vis: Tensor, v_vis: Tensor,
    visual_mask: Tensor, scale: float, softcap: float = 0.0, window: int = 0, merge: str = "alpha",
    causal_visual: bool = False, causal: bool = True,
) -> Tensor:  # fmt: skip
    return dattn_op(q, k, v, key_mask, q_vis, k_vis, v_vis, visual_mask, scale=scale, softcap=softcap or None,
                    window=window or None, merge=merge, causal_visual=causal_visual, causal=causal)  # fmt: skip


@decomposed_attention.register_kernel("cuda")
def _(q, k, v, key_mask, q_vis, k_vis, v_vis, visual_mask, scale, softcap=0.0, window=0, merge="alpha", causal_visual=False,
      causal=True):  # fmt: skip
    from .kernels import launch

    return launch(q, k, v, key_mask, q_vis, k_vis, v_vis, visual_mask, scale=scale, softcap=softcap or None,
                  window=window or None, merge=merge, causal_visual=causal_visual, causal=causal)  # fmt: skip


@decomposed_attention.register_fake
def _(q, k, v, key_mask, q_vis, k_vis, v_vis, visual_mask, scale, softcap=0.0, window=0, merge="alpha", causal_visual=False,
      causal=True):  # fmt: skip
    return torch.empty_like(q)
