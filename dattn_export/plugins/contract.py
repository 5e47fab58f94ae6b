"""The fused op `dattn::DecomposedAttention`, version 1: its inputs and attributes, defined once.

Every backend imports this instead of restating it: the ONNX node and its function body (`onnx_node.py`), the
Triton kernel (`triton_kernel.py`), the TensorRT plugin (`tensorrt_plugin.py`) and the torch.library op
(`torch_op.py`). The math itself is `modeling.attention.dattn_op`, which all of them are tested against.

Inputs (B batch, Hq query heads, Hkv KV heads, T queries, S text keys, V context keys, D head dim):
  q (B, Hq, T, D) rotated text queries; k, v (B, Hkv, S, D) text keys and values, the queries being the last T
  of the S slots; key_mask (B, S) real text keys; q_vis (B, Hq, T, D) the queries for the context keys (unrotated
  when debiased); k_vis, v_vis (B, Hkv, V, D) the context keys: `num_contexts` segments end to end (an image
  model's visual tokens; a video model's frames, then its audio); context_mask (B, V) integer, each key's segment
  1..num_contexts, 0 for no key (a bool mask: one segment; the exported graphs feed int32, which the TensorRT
  plugin's kernel reads). Output shaped like q.

Version 1 throughout: `num_contexts` defaults to 1 and a 0/1 mask means what it meant with one segment, so the
graphs exported before N segments keep their meaning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from ..modeling.attention import MERGE_MODES, dattn_op
from ..modeling.modeling_dattn import DAttnAttention

DOMAIN, TYPE, VERSION = "dattn", "DecomposedAttention", 1
ID = f"{DOMAIN}::{TYPE}"
INPUTS = ("q", "k", "v", "key_mask", "q_vis", "k_vis", "v_vis", "context_mask")
SHAPE_ATTRIBUTES = ("num_heads", "num_kv_heads", "head_dim")  # the node states them: TensorRT plugins need them
MAX_CONTEXTS = 3  # the kernels unroll one pass per segment
PLUGIN_ATTRIBUTES = {"plugin_namespace": DOMAIN, "plugin_version": str(VERSION)}  # how TensorRT's parser finds it


@dataclass(frozen=True)
class Attributes:
    """What a kernel is specialised on, with the defaults a node that omits an attribute means. 0 means off."""

    scale: float
    softcap: float = 0.0  # logits -> softcap * tanh(logits / softcap) before the softmax
    window: int = 0  # a query at slot i sees text slot j only when i - j < window
    merge: str = "alpha"  # alpha: one softmax over [visual ; text]; sum: one per segment, outputs added
    causal_context: int = 0  # visual keys take slots [0, V) before the text, under the causal and window rule
    causal: int = 1  # 0: every real text key is visible (attention within an image)
    num_contexts: int = 1  # context segments the context mask names; with sum, each has its own softmax

    def __post_init__(self):
        if self.merge not in MERGE_MODES:
            raise ValueError(f"{ID}: merge {self.merge!r} is not one of {MERGE_MODES}")
        if self.softcap < 0 or self.window < 0 or self.scale <= 0:
            raise ValueError(f"{ID}: scale must be > 0, softcap and window >= 0 (0 = off)")
        if not 1 <= self.num_contexts <= MAX_CONTEXTS or (self.causal_context and self.num_contexts != 1):
            raise ValueError(f"{ID}: num_contexts {self.num_contexts}: 1 to {MAX_CONTEXTS}, 1 with causal_context")

    @property
    def slots(self) -> int:
        """With keys split into shares, the states each share writes: the text's, then each context segment's (sum),
        or one for all of the contexts (alpha)."""
        return self.num_contexts + 1 if self.merge == "sum" else 2

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def defaults(cls) -> dict:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    @classmethod
    def from_reference(cls, **keywords) -> Attributes:
        """From the reference's keywords (None or False means off); the ones not given take the defaults."""
        types = typing.get_type_hints(cls)
        return cls(**{name: types[name](value or 0) for name, value in keywords.items()})

    def reference_keywords(self) -> dict:
        """The keywords of `modeling.attention.dattn_op`, where off is None."""
        return dict(
            scale=self.scale,
            softcap=self.softcap or None,
            window=self.window or None,
            merge=self.merge,
            causal_context=bool(self.causal_context),
            causal=bool(self.causal),
            num_contexts=self.num_contexts,
        )

    def node_attributes(self, num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
        """Everything an ONNX node carries: these attributes, the shape facts and the TensorRT plugin's."""
        return dict(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            **dataclasses.asdict(self),
            **PLUGIN_ATTRIBUTES,
        )


def check_shapes(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """What the Triton kernel's tiles and its GQA indexing need."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"{ID}: head_dim {head_dim} must be a power of two >= 16 (kernel tiles)")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{ID}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")


def reference(inputs: tuple[Tensor, ...], attributes: Attributes) -> Tensor:
    """The op's meaning: the reference math on its eight inputs."""
    return dattn_op(*inputs, **attributes.reference_keywords())


def from_node(node) -> Attributes:
    """A node's attributes (an onnx.NodeProto), omitted ones at their defaults."""
    from onnx import helper

    values = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in Attributes.names()}
    values = {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}
    return Attributes(**values)


@contextlib.contextmanager
def using_op(model: nn.Module, op: Callable[..., Tensor]):
    """While active, every attention of `model` calls `op` (same arguments as the reference) through its one seam,
    `DAttnAttention.op`: the ONNX exporter emits fused nodes this way, analyze records the inputs."""
    attentions = [m for m in model.modules() if isinstance(m, DAttnAttention)]
    for attention in attentions:
        attention.op = op
    try:
        yield
    finally:
        for attention in attentions:
            attention.op = dattn_op
