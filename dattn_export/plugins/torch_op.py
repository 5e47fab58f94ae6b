"""`torch.ops.dattn.decomposed_attention`: the DecomposedAttention op for PyTorch users.

On CUDA tensors it runs the Triton kernel (O(|V|) attention, no logits materialised); elsewhere the reference.
Arguments: the contract's inputs, then its attributes in order with their defaults (the schema is built from it).
"""

from __future__ import annotations

import typing

import torch

from . import contract
from .contract import Attributes

SCHEMA_TYPES = {float: "float", int: "int", str: "str"}


def schema() -> str:
    hints, defaults = typing.get_type_hints(Attributes), Attributes.defaults()

    def attribute(name: str) -> str:
        default = defaults.get(name)
        return f"{SCHEMA_TYPES[hints[name]]} {name}" + ("" if default is None else f"={default!r}".replace("'", '"'))

    arguments = [f"Tensor {name}" for name in contract.INPUTS] + [attribute(name) for name in Attributes.names()]
    return f"({', '.join(arguments)}) -> Tensor"


def _split(args: tuple) -> tuple[tuple, Attributes]:
    count = len(contract.INPUTS)
    return args[:count], Attributes(*args[count:])


def _reference(*args) -> torch.Tensor:
    inputs, attributes = _split(args)
    return contract.reference(inputs, attributes)


def _kernel(*args) -> torch.Tensor:
    from .triton_kernel import launch

    inputs, attributes = _split(args)
    return launch(*inputs, attributes)


decomposed_attention = torch.library.custom_op(
    "dattn::decomposed_attention", _reference, mutates_args=(), schema=schema()
)
decomposed_attention.register_kernel("cuda")(_kernel)
decomposed_attention.register_fake(lambda q, *rest: torch.empty_like(q))


def model_op(*inputs, **keywords) -> torch.Tensor:
    """The op as the model's attention calls it (the reference's keywords), through `torch.ops.dattn`: the Triton
    kernel on CUDA tensors, the reference elsewhere. The model takes it with `contract.using_op(model, model_op)`."""
    attributes = Attributes.from_reference(**keywords)
    return decomposed_attention(*inputs, *(getattr(attributes, name) for name in Attributes.names()))
