"""Where the reference model's weights live: never randomly initialised, never held twice.

The model is built with its parameters on the meta device (no memory, no initialisation) and its buffers as usual
(rotary tables, position ids: small, computed from the config); each weight is then read from the checkpoint, cast on
the way, into a tensor of its own. Never a view of the mapped file: a tensor mapped where the file puts it is not
64-byte aligned, and the matrix kernels then take other paths whose results differ in the last bits (measured: 1.7e-6
on the logits of a tiny model), so the same checkpoint would give other numbers by where it lies.
When the whole model does not fit, `stream` keeps only the small weights outside the layers in memory: each layer
(every element of a ModuleList: the decoder's layers, the towers' encoder layers) reads its weights as it is entered
and drops them as it leaves, the same checked casts into the same fresh tensors, so the numbers are the whole
model's; the two tables outside them (the token embedding and the lm_head: 3.7 GB each in fp32 for a 256000-token
vocabulary) are read a chunk of rows at a time, the embedding only for the rows its tokens pick, the head a slice of
the logits per chunk (each logit is the same dot product of the same fresh, aligned row, so the same number).
`stand_in` gives each parameter a placeholder of its shape and dtype that takes no memory (one element, broadcast),
so a model can be traced for export without its weights (`stages/onnx_export.py` binds them afterwards).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from .plan import checked_cast, checked_chunks
from .registry import Lazy

TABLE_CHUNK_BYTES = 64 << 20  # the token embedding and the lm_head are read this much (in the model's dtype) at a time


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While active, every parameter a module registers is moved to the meta device as it is registered: building a
    model allocates and initialises none of them (its initialisation runs on meta tensors: no work). Buffers are
    made as usual."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_model(model_class: type[nn.Module], config, dtype: torch.dtype) -> nn.Module:
    """The model without weights: parameters on meta in `dtype`, floating buffers cast to `dtype` as a whole-model
    `.to(dtype)` casts them."""
    with parameters_on_meta():
        model = model_class(config)
    return model.to(dtype).eval()


def set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """A parameter as a model's own are made (`requires_grad` on: PyTorch's matmul folds a non-contiguous input
    differently when the weight does not require grad, even under no_grad, and the numbers then differ)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=tensor.is_floating_point())


def tie(model: nn.Module) -> None:
    """Tied parameters (lm_head to the embedding) share one tensor again after their weights were set."""
    if getattr(model.config, "tie_word_embeddings", False):
        for name, target in getattr(model, "_tied_weights_keys", {}).items():
            set_parameter(model, name, model.get_parameter(target))


def materialize(
    model: nn.Module,
    tensors: dict[str, Lazy],
    stored_names: dict[str, str],
    dtype: torch.dtype,
    complete: bool = True,
    device: str = "cpu",
) -> nn.Module:
    """Every parameter of a model built by `empty_model` set from the checkpoint's tensors (canonical names), on
    `device`, one tensor at a time; `complete=False`: some are left for `stream`."""
    for name, lazy in tensors.items():
        set_parameter(model, name, checked_cast(stored_names[name], lazy, dtype).to(device))
    tie(model)
    if not complete:
        return model
    missing = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"no weight for {missing[0]} (and {len(missing) - 1} more)")
    return model


# A unit's entry points: the decoder layers' streams are methods of their own, the towers' layers are called, a
# position embedding is also asked for some positions (`at`).
LAYER_ENTRY_POINTS = ("forward", "context_forward", "text_forward", "at")


def layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every element of the outermost ModuleLists, and the modules of the classes the model names in
    `_streamed_modules`, by name: the units `stream` reads one at a time."""
    found: dict[str, nn.Module] = {}
    streamed = getattr(model, "_streamed_modules", ())
    for name, module in model.named_modules():
        inside = any(name.startswith(prefix + ".") for prefix in found)
        if isinstance(module, nn.ModuleList) and not inside:
            found |= {f"{name}.{k}": layer for k, layer in enumerate(module)}
        elif type(module).__name__ in streamed and not inside:
            found[name] = module
    return found


def parameter_bytes(model: nn.Module, prefixes=("",)) -> int:
    return sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if any(name.startswith(prefix) for prefix in prefixes)
    )


def tables(model: nn.Module) -> dict[str, nn.Module]:
    """The token embedding and the lm_head, by the name of their weight: what `stream` reads a chunk of rows at a
    time."""
    names = {id(module): name for name, module in model.named_modules()}
    return {f"{names[id(m)]}.weight": m for m in (model.get_input_embeddings(), model.get_output_embeddings())}


def streamed_bytes(model: nn.Module) -> int:
    """The weights `stream` holds at once: those outside the layers and tables, the largest layer and a chunk of a
    table."""
    table_bytes = {id(m.weight): m.weight.numel() * m.weight.element_size() for m in tables(model).values()}
    layer_bytes = [parameter_bytes(layer) for layer in layers(model).values()]
    held = parameter_bytes(model) - sum(layer_bytes) - sum(table_bytes.values())
    return held + max(layer_bytes) + min(TABLE_CHUNK_BYTES, max(table_bytes.values()))


def stream(model: nn.Module, tensors: dict[str, Lazy], stored_names: dict[str, str], dtype: torch.dtype) -> nn.Module:
    """A model built by `empty_model` whose layers read their weights when entered and drop them when they return,
    and whose embedding and lm_head read theirs a chunk of rows at a time; every other weight is set now."""
    units = layers(model)
    table_modules = tables(model)
    tied = getattr(model, "_tied_weights_keys", {}) if getattr(model.config, "tie_word_embeddings", False) else {}
    streamed = lambda name: name in table_modules or any(name.startswith(p + ".") for p in units)
    materialize(model, {n: t for n, t in tensors.items() if not streamed(n)}, stored_names, dtype, complete=False)
    for prefix, unit in units.items():
        start = prefix + "."
        own = {n.removeprefix(start): (stored_names[n], t) for n, t in tensors.items() if n.startswith(start)}
        for method in LAYER_ENTRY_POINTS:
            if hasattr(unit, method):
                setattr(unit, method, with_weights(unit, getattr(type(unit), method), own, dtype))
    for name, module in table_modules.items():
        stored = tied.get(name, name)
        read = with_rows if isinstance(module, nn.Embedding) else with_row_chunks
        module.forward = read(module, type(module).forward, stored_names[stored], tensors[stored], dtype)
    return model


def with_weights(unit: nn.Module, method, tensors: dict[str, tuple[str, Lazy]], dtype: torch.dtype):
    """`method` of `unit` with the unit's weights (names relative to it) read before it runs and dropped after. The
    unit is held weakly: a model whose layers hold their own wrapped methods would otherwise be a reference cycle,
    freed only when the garbage collector runs, and two models would then be in memory at once."""
    held = weakref.ref(unit)

    def run(*args, **kwargs):
        unit = held()
        if not any(p.is_meta for p in unit.parameters()):  # called from another of its entry points
            return method(unit, *args, **kwargs)
        for name, (stored_name, lazy) in tensors.items():
            set_parameter(unit, name, checked_cast(stored_name, lazy, dtype))
        try:
            return method(unit, *args, **kwargs)
        finally:
            for name, (_, lazy) in tensors.items():
                drop(unit, name, lazy, dtype)

    return run


def drop(module: nn.Module, name: str, lazy: Lazy, dtype: torch.dtype) -> None:
    """A weight read for one call let go: back on the meta device, with the shape and dtype it was read in."""
    kept = dtype if lazy.dtype.is_floating_point else lazy.dtype
    set_parameter(module, name, torch.empty(lazy.shape, dtype=kept, device="meta"))


def rows_per_chunk(lazy: Lazy, dtype: torch.dtype) -> int:
    """A multiple of 64 rows: a matrix-vector product over a row count that is not a multiple of the vector width
    (16 floats) takes another path for its tail, and the logits of a one-token step then differ in the last bit
    (measured on this machine's oneDNN/MKL; whole vocabularies of 32000 and 256000 rows end on a multiple of 64)."""
    rows = TABLE_CHUNK_BYTES // (lazy.shape[1] * dtype.itemsize)
    return max(64, rows - rows % 64)


def with_rows(module: nn.Embedding, method, stored_name: str, lazy: Lazy, dtype: torch.dtype):
    """An embedding's `method` with a weight of only the rows its ids pick (read a chunk of rows at a time), the ids
    renumbered into it: the same vectors, without the table in memory."""
    held = weakref.ref(module)

    def run(ids: torch.Tensor, *args, **kwargs):
        module, (picked, renumbered) = held(), torch.unique(ids, return_inverse=True)
        width, start, rows = lazy.shape[1], 0, []
        for chunk in checked_chunks(stored_name, lazy, dtype, rows_per_chunk(lazy, dtype) * width):
            chunk = chunk.view(-1, width)
            inside = picked[(picked >= start) & (picked < start + len(chunk))]
            rows.append(chunk[inside - start])
            start += len(chunk)
        set_parameter(module, "weight", torch.cat(rows))
        try:
            return method(module, renumbered, *args, **kwargs)
        finally:
            drop(module, "weight", lazy, dtype)

    return run


def with_row_chunks(module: nn.Linear, method, stored_name: str, lazy: Lazy, dtype: torch.dtype):
    """A bias-free linear map's `method` run once per chunk of its weight's rows, the outputs joined: the same
    numbers, with one chunk in memory."""
    held = weakref.ref(module)

    def run(x: torch.Tensor) -> torch.Tensor:
        module, width, outputs = held(), lazy.shape[1], []
        try:
            for chunk in checked_chunks(stored_name, lazy, dtype, rows_per_chunk(lazy, dtype) * width):
                set_parameter(module, "weight", chunk.view(-1, width))
                outputs.append(method(module, x))
        finally:
            drop(module, "weight", lazy, dtype)
        return torch.cat(outputs, dim=-1)

    return run


def stand_in(model: nn.Module) -> nn.Module:
    """Every meta parameter replaced by a placeholder of its shape and dtype that takes no memory (a zero broadcast
    to the shape): a model to trace whose weights are bound later."""
    for name, param in list(model.named_parameters()):
        set_parameter(model, name, torch.zeros((), dtype=param.dtype).expand(param.shape))
    tie(model)
    return model


def is_stand_in(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 1 and all(stride == 0 for stride in tensor.stride())
