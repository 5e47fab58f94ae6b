"""`onnx`: the three graphs a deployment needs, with one fused attention node per decoder layer.

  vision.onnx     pixel_values (B, images, 3, H, W) -> context_embeds (B, V, hidden), context_attention_mask (B, V)
  context_kv.onnx  context_embeds, context_attention_mask -> context_key_values.{i}.key/.value (B, Hkv, V, D):
                  the visual stream, once per image, position-free, cacheable
  decoder.onnx    input_ids, position_ids, attention_mask (B, past + T), context_attention_mask,
                  past_key_values.{i}.key/.value, context_key_values.{i}.key/.value
                  -> logits, present.{i}.key/.value; one graph for prefill and decode
Large graphs keep their weights in `NAME.onnx.data`; context_kv.onnx reads the layer weights it shares with the
decoder (norms, K/V projections, MLPs) from decoder.onnx.data, so each is on the disk once.
A layer with WINGS learners also caches `.wings_key/.wings_value` (B, hidden / D, S, D) in each of these.

A video model (mm_input_type "video") has two context streams, frames and audio, each run through its own graph
in parts (so memory does not grow with the length), then through context_kv, and laid end to end as the decoder's
context, `context_attention_mask` giving each key its stream (1 frames, 2 audio, 0 none):
  vision.onnx     pixel_values (N, 3, H, W) frames, frame_index (N,), num_frames () -> context_embeds (1, N * t, hidden)
                  space-to-depth pools (Vidi1.5) also take pooled_grid (s,): each frame is pooled to s x s tokens,
                  its grid resized first past the released resize budget (streams.pooled_side), so t = s * s
  audio.onnx      input_features (C, mel bins, chunk frames) 30 s chunks, first_chunk (), mel_frames () ->
                  audio_embeds (1, C * a, hidden), audio_attention_mask (1, C * a): tokens within the sample

With `--attention fused` every attention is one `dattn::DecomposedAttention` node (attributes: heads, KV
heads, head dim, scale, soft-cap, window, merge, TensorRT plugin namespace/version) with a model-local
function of standard ops attached; with `standard` the reference math is exported as plain ONNX ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import onnx
import onnx_ir as ir
import torch
from onnxscript.optimizer import _constant_folding
from torch import nn

from .. import __version__, memory
from ..artifacts import (
    DTYPES,
    ONNX_FORMAT,
    SCHEMES,
    AttentionExport,
    ExportedModel,
    ExportSource,
    Graph,
    GraphValue,
    OnnxManifest,
    Quantization,
    Scheme,
    Tool,
    WeightSource,
    Wings,
    atomic_dir,
    check_output,
    dtype_name,
)
from ..checkpoints.names import audio_tower_role
from ..checkpoints.plan import checked_cast, checked_chunks
from ..checkpoints.registry import Lazy
from ..checkpoints.safetensors_writer import RangeCopier
from ..checkpoints.source import open_source
from ..checkpoints.weights import empty_model, is_stand_in, parameter_bytes, stand_in
from ..errors import InputError
from ..graphs import GraphSpec, graph_specs
from ..modeling.modeling_dattn import MODEL_CLASSES
from ..modeling.streams import context_graphs
from ..plugins import contract
from ..plugins.onnx_node import attach_function, fused_nodes
from ..runtime.genai import GENAI_CONFIG, write_genai_config
from ..runtime.ort import external_tensors
from ..sidefiles import read_json
from ..ui import quiet
from .quantize import KEPT, QUANTIZED_GRAPHS, quantize_graph, quantized_bytes

DEFAULT_OPSET = 18  # accepted by TensorRT 10/11's ONNX parsers and ONNX Runtime
SUPPORTED_OPSETS = range(18, 24)
MAX_IR_VERSION = 10  # ONNX Runtime 1.31 reads up to 13; 10 is what opset 18-23 models need
EXTERNAL_DATA_BYTES = 64 << 20  # models with more weights keep them in .data files: never re-serialized in memory


WRITE_CHUNK_BYTES = 64 << 20  # a weight is cast and written this much at a time
TRANSPOSE_BLOCK_BYTES = 256 << 20  # a transposed weight is written this much at a time, a pass over it each


@dataclasses.dataclass(frozen=True)
class CheckpointWeight:
    """One weight as the export writes it: read from the checkpoint (mapped), checked and cast on the way."""

    stored_name: str
    lazy: Lazy
    dtype: torch.dtype

    def load(self) -> torch.Tensor:
        return checked_cast(self.stored_name, self.lazy, self.dtype)

    def chunks(self, elements: int) -> Iterator[torch.Tensor]:
        return checked_chunks(self.stored_name, self.lazy, self.dtype, elements)


Weights = dict[str, CheckpointWeight]  # canonical name -> the weight


def checkpoint_weights(source, dtype: torch.dtype) -> Weights:
    """Each weight of the checkpoint; tied weights (lm_head) are their target's."""
    weights = {name: CheckpointWeight(source.stored_names[name], lazy, dtype) for name, lazy in source.tensors.items()}
    if source.config.tie_word_embeddings:
        for name, target in MODEL_CLASSES[source.config.model_type]._tied_weights_keys.items():
            weights.setdefault(name, weights[target])
    return weights


def ir_tensor(tensor: torch.Tensor) -> ir.Tensor:
    """A torch tensor as the ONNX IR holds it (numpy has no bfloat16: the IR's own stands in)."""
    if tensor.dtype == torch.bfloat16:
        return ir.Tensor(tensor.view(torch.uint16).numpy().view(ir.DataType.BFLOAT16.numpy()))
    return ir.Tensor(tensor.numpy())


class StreamedWeight(ir.LazyTensor):
    """A bound weight: computed whole only where a pass folds it; written to the .data file a chunk at a time, so
    that writing a 3.7 GB embedding table needs 64 MiB. `source`: its checkpoint tensor, by canonical name."""

    def __init__(self, weight: CheckpointWeight, dtype: ir.DataType, shape: ir.Shape, name: str, canonical: str):
        super().__init__(lambda: ir_tensor(weight.load()), dtype, shape, name=name)
        self.weight, self.source = weight, WeightSource(tensor=canonical)

    def tofile(self, file) -> None:
        for chunk in self.weight.chunks(max(1, WRITE_CHUNK_BYTES // self.weight.dtype.itemsize)):
            file.write(chunk.view(torch.uint8).numpy())


class FoldedWeight(ir.LazyTensor):
    """A fold of bound weights, computed when it is written; `source` says how from the checkpoint (None: from a
    weight whose source is unknown), for the quantized weights' check."""

    def __init__(self, fold: Callable, dtype: ir.DataType, shape: ir.Shape, name: str, source: WeightSource | None):
        super().__init__(fold, dtype, shape, name=name)
        self.source = source


class TransposedWeight(FoldedWeight):
    """A folded Transpose of a 2-D bound weight (a Linear's, as MatMul takes it): computed whole only where a pass
    needs it (a quantizer); written a block of its rows at a time, each block the same columns of every chunk of the
    checkpoint's rows. Writing a tied 3.7 GB head (256000 rows) then holds one block, not the weight twice, for a few
    passes over the mapped weight."""

    def __init__(self, fold: Callable, dtype: ir.DataType, shape: ir.Shape, name: str, source: WeightSource,
                 weight: CheckpointWeight):  # fmt: skip
        super().__init__(fold, dtype, shape, name, source)
        self.weight = weight

    def tofile(self, file) -> None:
        columns, rows = self.shape.numpy()  # the checkpoint's weight is (rows, columns)
        itemsize = self.weight.dtype.itemsize
        block = max(1, TRANSPOSE_BLOCK_BYTES // (rows * itemsize))
        rows_per_chunk = max(1, WRITE_CHUNK_BYTES // (columns * itemsize))
        for first in range(0, columns, block):
            out = torch.empty(min(block, columns - first), rows, dtype=self.weight.dtype)
            row = 0
            for chunk in self.weight.chunks(rows_per_chunk * columns):
                piece = chunk.view(-1, columns)
                out[:, row : row + len(piece)] = piece[:, first : first + block].T
                row += len(piece)
            file.write(out.view(torch.uint8).numpy())


def bind_weights(graph: ir.Graph, module: nn.Module, weights: Weights) -> None:
    """Every stand-in initializer of a traced graph bound to its checkpoint tensor, read when the graph is written.
    The graph names a parameter by its path in the traced module: the graph module's `model.` and then the
    canonical name."""
    canonical = {name: name.removeprefix("model.") for name, _ in module.named_parameters(remove_duplicate=False)}
    for name, value in graph.initializers.items():
        held = value.const_value
        if is_stand_in(held.raw):
            value.const_value = StreamedWeight(weights[canonical[name]], held.dtype, held.shape, name, canonical[name])


class LazyFolding(_constant_folding.FoldConstantsPass):
    """onnxscript's constant folding, except that a fold of a bound weight stays lazy: computed from the checkpoint
    when the graph is written. A weight-only node that makes nothing larger (a Transpose, the GQA group sum of a
    Reshape and a ReduceSum) is folded whatever its size, without being computed here: onnxscript leaves large ones
    in the graph, where no quantizer sees a constant matrix. Other folds are computed once to decide on them. Without
    it every folded weight of a 9 B model would sit in memory until the save."""

    def process_node(self, node: ir.Node, is_function: bool):
        weights = [x for x in node.inputs if x is not None and isinstance(x.const_value, ir.LazyTensor)]
        constant = all(x is None or x.const_value is not None for x in node.inputs)
        shape = self.folded_shape(node)
        if is_function or not weights or not constant or node.domain != "" or shape is None:
            return super().process_node(node, is_function)
        if (
            _constant_folding._reference_evaluator.get_evaluator(node.domain, node.op_type, self._opset_imports[""])
            is None
        ):
            return None  # an op onnxscript cannot compute (Gelu from opset 20): it stays a node, its weights lazy
        if any(len(w.uses()) != 1 for w in weights):  # as onnxscript decides: a weight used elsewhere too stays
            return None if node.op_type == "Transpose" else super().process_node(node, is_function)
        if math.prod(shape.numpy()) > sum(w.const_value.size for w in weights):
            return super().process_node(node, is_function)
        name = node.outputs[0].name
        folded = self.later(node, shape, name)
        value = ir.Value(name=name, type=ir.TensorType(folded.dtype), shape=shape, const_value=folded)
        node.graph.register_initializer(value)
        return _constant_folding.Replacement([value], [])

    @staticmethod
    def folded_shape(node: ir.Node) -> ir.Shape | None:
        """The one output's static shape, known without computing it (a Transpose's from its perm)."""
        if len(node.outputs) != 1:
            return None
        if node.op_type == "Transpose" and len(node.inputs) == 1:
            weight = node.inputs[0]
            perm = node.attributes.get_ints("perm", None) or list(reversed(range(len(weight.shape))))
            return ir.Shape([weight.shape[axis] for axis in perm])
        shape = node.outputs[0].shape
        return shape if shape is not None and shape.is_static() else None

    def new_initializer(self, node: ir.Node, array):
        value = super().new_initializer(node, array)
        if value is not None and any(isinstance(x.const_value, ir.LazyTensor) for x in node.inputs if x is not None):
            value.const_value = self.later(node, value.shape, value.name)
        return value

    def later(self, node: ir.Node, shape: ir.Shape, name: str) -> ir.LazyTensor:
        """The node's output, computed from its (lazy) inputs when it is written."""
        inputs = [None if x is None else x.const_value for x in node.inputs]
        op = (node.domain, node.op_type, self._opset_imports[node.domain])
        attributes = {
            key: ir.serde.serialize_tensor(a.value) if a.type == ir.AttributeType.TENSOR else a.value
            for key, a in node.attributes.items()
        }

        def fold() -> ir.Tensor:
            arrays = [None if t is None else t.numpy() for t in inputs]
            result = _constant_folding._reference_evaluator.evaluate(*op, *arrays, **attributes)
            if result is None:  # process_node folds only what the evaluator computes: a bug if it comes here
                raise RuntimeError(f"{name}: {op[1]} could not be computed from its weights")
            return ir.tensor(result)

        dtype = node.outputs[0].dtype or next(t.dtype for t in inputs if t is not None)
        weight, source = inputs[0], fold_source(node, inputs)
        swaps_axes = len(shape) == 2 and list(node.attributes.get_ints("perm", [1, 0])) == [1, 0]  # not [0, 1]
        if node.op_type == "Transpose" and isinstance(weight, StreamedWeight) and swaps_axes:
            return TransposedWeight(fold, dtype, shape, name, source, weight.weight)
        return FoldedWeight(fold, dtype, shape, name, source)


SMALL_CONSTANT = 64  # elements: a shape, axes or a scalar, which a fold's source records by value


def fold_source(node: ir.Node, inputs: list) -> WeightSource | None:
    """How a fold computes its value from the checkpoint: the node's op over its inputs' sources (None where one is
    unknown: a large constant, an attribute that is no plain number, string or list of numbers)."""
    sources = []
    for tensor in inputs:
        if tensor is None or isinstance(tensor, ir.LazyTensor):
            sources.append(None if tensor is None else getattr(tensor, "source", None))
            if tensor is not None and sources[-1] is None:
                return None
        elif tensor.size <= SMALL_CONSTANT:
            array = tensor.numpy()
            sources.append(
                WeightSource(constant=array.ravel().tolist(), dtype=str(array.dtype), shape=list(array.shape))
            )
        else:
            return None
    attributes = {key: a.value for key, a in node.attributes.items()}
    for key, value in attributes.items():
        if isinstance(value, (list, tuple)) and all(isinstance(x, (int, float)) for x in value):
            attributes[key] = list(value)
        elif not isinstance(value, (int, float, str)):
            return None
    return WeightSource(op=node.op_type, attributes=attributes, inputs=sources)


@contextlib.contextmanager
def lazy_folding():
    """torch's optimisation of an exported graph (onnxscript's optimize_ir and fusions, the same passes in the same
    order, so the graph and its data are what a plain torch.onnx.export writes) with `LazyFolding`."""
    plain = _constant_folding.FoldConstantsPass
    _constant_folding.FoldConstantsPass = LazyFolding
    try:
        yield
    finally:
        _constant_folding.FoldConstantsPass = plain


@contextlib.contextmanager
def errors_only(logger: str):
    """A logger's warnings silenced: torch's exporter logs a line per torchvision op it cannot register when
    torchvision is absent, which would bury a one-line error (we export no torchvision op)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def export_graph(
    spec: GraphSpec,
    weights: Weights,
    path: Path,
    opset: int,
    fused: bool,
    low_precision: bool,
    external: bool,
    rewrite: Callable[[ir.Model], None] | None = None,
) -> None:
    """Export one graph. The module is traced with stand-in weights (no memory); each weight then streams from the
    checkpoint into a .data file as the graph is written (through `rewrite`'s lazy tensors where it quantizes), so
    only the small graph proto is ever edited and checked in memory; small graphs are then made single-file."""
    quiet = errors_only("torch.onnx._internal.exporter._registration")
    with torch.no_grad(), warnings.catch_warnings(), quiet, fused_nodes(spec.module) if fused else nullcontext():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            spec.module,
            spec.args,
            dynamic_shapes=spec.dynamic_shapes,
            input_names=list(spec.inputs),
            output_names=spec.outputs,
            dynamo=True,
            opset_version=opset,
            optimize=False,
            verbose=False,
        )
    bind_weights(program.model.graph, spec.module, weights)
    with lazy_folding():
        program.optimize()
    if rewrite:
        rewrite(program.model)
    without_tracebacks(program.model)
    # as torch's ONNXProgram.save writes it, one tensor at a time: each read from the checkpoint as it is written
    ir.save(program.model, path, external_data=path.name + ".data", max_workers=1)
    del program
    graph = rms_norm_as_quotient(onnx.load(path, load_external_data=False))
    attach_function(graph, low_precision)
    graph.ir_version = min(graph.ir_version, MAX_IR_VERSION)
    onnx.save(graph, path)
    onnx.checker.check_model(str(path), full_check=True)
    data = path.with_name(path.name + ".data")
    if not external and data.is_file():  # small: weights back inline, one file per graph
        onnx.save(onnx.load(path), path)
        data.unlink()


def without_tracebacks(model: ir.Model) -> None:
    """Drops what the exporter notes on each node: the Python stack it was traced from (this machine's paths and
    our source's line numbers), its FX node and scopes, a third of a small graph's bytes. A graph is then the same
    bytes wherever it is exported, and from any revision of our code that computes the same."""
    for graph in model.graphs():
        for node in graph.all_nodes():
            node.metadata_props.clear()


def share_weights(folder: Path, sharer: str, owner: str) -> int:
    """Point `sharer`.onnx's external tensors whose bytes `owner`.onnx.data already holds at those bytes, and rewrite
    `sharer`.onnx.data with the rest, so that each weight is on the disk once (context_kv's K/V projections and MLPs are
    the decoder's). Tensors match by type, shape and sha256: one that differs (o_proj's folded group sum) is kept.
    ONNX Runtime's CPU provider maps external data, so both sessions read the shared bytes through the same pages
    (each still keeps its own prepacked copy: the Python API has no shared prepacked-weights container, and without
    prepacking an int4 MatMul ran 45x slower). Returns the bytes the sharer now reads from the owner's file."""
    paths = {graph: folder / f"{graph}.onnx" for graph in (sharer, owner)}
    protos = {graph: onnx.load(path, load_external_data=False) for graph, path in paths.items()}
    kind = {graph: {t.name: (t.data_type, tuple(t.dims)) for t in protos[graph].graph.initializer} for graph in paths}
    ranges = {graph: external_tensors(protos[graph].graph) for graph in paths}
    # only a type and shape both graphs have can be shared: the rest is not hashed
    wanted = {kind[sharer][name] for name in ranges[sharer]} & {kind[owner][name] for name in ranges[owner]}
    candidates = {graph: [n for n in ranges[graph] if kind[graph][n] in wanted] for graph in paths}
    digests = {graph: dict(zip(candidates[graph], range_digests(folder, [ranges[graph][n] for n in candidates[graph]])))
               for graph in paths}  # fmt: skip
    held = {(kind[owner][name], digest): ranges[owner][name] for name, digest in digests[owner].items()}
    data = paths[sharer].with_name(paths[sharer].name + ".data")
    partial, offset, shared = data.with_name(data.name + ".partial"), 0, 0
    copier = RangeCopier()
    with open(data, "rb", buffering=0) as source, open(partial, "wb", buffering=0) as rest:
        for tensor in protos[sharer].graph.initializer:
            if tensor.name not in ranges[sharer]:
                continue
            _, start, length = ranges[sharer][tensor.name]
            found = held.get((kind[sharer][tensor.name], digests[sharer].get(tensor.name)))
            if found:
                point_at(tensor, *found)
                shared += length
            else:
                copier.copy(source.fileno(), rest.fileno(), start, length)
                point_at(tensor, data.name, offset, length)
                offset += length
    if offset:
        partial.replace(data)
    else:  # every tensor is read from the owner's file
        partial.unlink()
        data.unlink()
    onnx.save(protos[sharer], paths[sharer])
    onnx.checker.check_model(str(paths[sharer]), full_check=True)
    return shared


def range_digests(folder: Path, ranges: list[tuple[str, int, int]]) -> list[str]:
    """sha256 of each (file, offset, length) range of the folder's files, one range per core at a time."""

    def digest(file: str, offset: int, length: int) -> str:
        hashed, end = hashlib.sha256(), offset + length
        with open(folder / file, "rb", buffering=0) as f:
            while offset < end:  # os.pread and sha256 let go of the GIL
                chunk = os.pread(f.fileno(), min(end - offset, WRITE_CHUNK_BYTES), offset)
                if not chunk:
                    raise InputError(folder / file, f"ends before byte {end}, which its graph reads")
                hashed.update(chunk)
                offset += len(chunk)
        return hashed.hexdigest()

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        return list(pool.map(lambda r: digest(*r), ranges))


def point_at(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def rms_norm_as_quotient(graph: onnx.ModelProto) -> onnx.ModelProto:
    """y * Reciprocal(Sqrt(x)) (torch's rsqrt in every RMSNorm) -> y / Sqrt(x), the form ONNX Runtime fuses into one
    SimplifiedLayerNormalization kernel: 6 fewer nodes a norm, about 0.4 ms of a 2-thread int4 decode step of 11 ms
    on the bench model (bench/serving.py). The same value to within rounding."""
    from onnxscript.rewriter import pattern, rewrite

    rule = pattern.RewriteRule(
        lambda op, x, y: op.Mul(y, op.Reciprocal(op.Sqrt(x))), lambda op, x, y: op.Div(y, op.Sqrt(x))
    )
    return rewrite(graph, pattern_rewrite_rules=pattern.RewriteRuleSet([rule], commute=True))


def describe_values(values) -> list[GraphValue]:
    kinds = {v: k for k, v in onnx.TensorProto.DataType.items()}
    return [
        GraphValue(
            value.name,
            kinds[value.type.tensor_type.elem_type].lower(),
            [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim],
        )
        for value in values
    ]


def build_manifest(source, model, attention: str, dtype: torch.dtype, opset: int, out: Path) -> OnnxManifest:
    config = model.config
    graphs = {}
    for name in context_graphs(config.mm_input_type):
        graph = onnx.load(out / f"{name}.onnx", load_external_data=False).graph
        fused = sum(1 for n in graph.node if n.domain == contract.DOMAIN)
        graphs[name] = Graph(f"{name}.onnx", fused, describe_values(graph.input), describe_values(graph.output))
    generation = out / "generation_config.json"
    op = {"domain": contract.DOMAIN, "type": contract.TYPE, "version": contract.VERSION, **contract.PLUGIN_ATTRIBUTES}
    return OnnxManifest(
        format=ONNX_FORMAT,
        tool=Tool("dattn-export", __version__),
        source=ExportSource(str(Path(source.reader.path).absolute()), source.reader.layout),
        model=ExportedModel(
            model_type=config.model_type,
            dattn_mode=config.dattn_mode,
            merge=config.merge,
            diagonal=config.use_diagonal,
            debias=config.use_debias,
            layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            image_size=config.vision_config["image_size"],
            tokens_per_image=config.tokens_per_image,
            text_positions="text tokens only" if config.use_debias else "after the visual tokens",
            wings=Wings(config.wings_rank, config.wings_layer_indices, config.wings_heads)
            if config.wings_rank
            else None,
            audio_tower=None if config.audio_config is None else audio_tower_role(config),
            input_type=config.mm_input_type,
            num_contexts=config.num_contexts,
            patch_grid=config.patch_grid,
            **{fact: value for stream in config.streams for fact, value in stream.runtime_facts(config).items()},
        ),
        attention=AttentionExport(attention, op if attention == "fused" else None),
        dtype=dtype_name(dtype),
        opset=opset,
        graphs=graphs,
        generation=read_json(generation, "generation config") if generation.is_file() else {},
        files=sorted(p.name for p in out.iterdir()),
    )


def export_onnx(
    checkpoint: Path,
    out: Path,
    attention: str = "fused",
    dtype: str = "fp32",
    opset: int = DEFAULT_OPSET,
    force: bool = False,
    base: Path | None = None,
    vision_heads: int | None = None,
    progress=quiet,
    quantize: Scheme | None = None,
) -> OnnxManifest:
    """`quantize`: context_kv.onnx's and decoder.onnx's MatMuls weight-only quantized by ONNX Runtime's quantizer.
    `progress`: `ui.progress` to show the graphs as they are written (the CLI's), or `ui.quiet`."""
    if opset not in SUPPORTED_OPSETS:
        raise InputError(
            "--opset", f"{opset} is not supported (choose {SUPPORTED_OPSETS.start}-{SUPPORTED_OPSETS.stop - 1})"
        )
    source = open_source(checkpoint, base, vision_heads)
    if dtype == "auto":  # the checkpoint's, as convert takes it (fp32 for a type the graphs have no name for)
        dtype = next((d.short for d in DTYPES.values() if d.torch == source.output_dtype(dtype)), "fp32")
    if quantize and (quantize.scheme not in SCHEMES or dtype != "fp32"):
        raise InputError("--quantize", f"{quantize.scheme}: int4 or int8 weights of an fp32 export (--dtype fp32)")
    if dtype == "bf16" and opset < 22:
        raise InputError(
            "--dtype bf16", f"needs --opset 22 or later: ONNX's Conv accepts bfloat16 from opset 22 (asked {opset})"
        )
    check_output(out, force, source.inputs())
    source.carried()
    config = source.config
    writes_audio = "audio" in (stream.graph for stream in config.streams)
    if writes_audio and config.audio_config["max_source_positions"] % config.mm_audio_pool_size:
        positions = config.audio_config["max_source_positions"]
        raise InputError(
            source.config_path,
            f"mm_audio_pool_size {config.mm_audio_pool_size} does not divide the {positions} encoder positions of a "
            "30 s chunk: audio.onnx pools chunk by chunk",
        )
    torch_dtype = DTYPES[dtype].torch
    source.raise_first_problem()
    model = stand_in(empty_model(MODEL_CLASSES[config.model_type], config, torch_dtype))
    weights = checkpoint_weights(source, torch_dtype)
    weight_bytes = parameter_bytes(model)
    # every weight is written a chunk at a time (a transposed one a block of rows at a time); a quantized one is read,
    # transposed and quantized whole: the head too with --quantize-lm-head, tied or not (the table is in row chunks)
    head_too = bool(quantize and quantize.lm_head)
    largest = max(
        p.nbytes
        for name, p in model.named_parameters(remove_duplicate=False)
        if not name.endswith("embed_tokens.weight") and (head_too or not name.startswith("lm_head."))
    )
    memory.require(3 * largest, "onnx: the largest weight read, transposed and quantized", "a machine with more memory")
    matmuls, sources = {}, {}

    def quantized(name: str, model: ir.Model) -> None:
        sources[name] = quantize_graph(model, quantize, config.hidden_size, config.vocab_size)
        matmuls[name] = sum(node.op_type == "MatMulNBits" for node in model.graph)

    specs = graph_specs(model, torch_dtype)
    # the layers' weights are written in context_kv.onnx's data and decoder.onnx's before context_kv's are shared
    needed = 2 * (weight_bytes if not quantize else quantized_bytes(model, quantize))
    with (
        atomic_dir(out, overwrite=force, reading=source.inputs(), needed=needed) as tmp,
        progress("exporting graphs", len(specs), "graphs") as advance,
    ):
        for name, spec in specs.items():
            advance(0, f"exporting {name}.onnx")
            export_graph(
                spec,
                weights,
                tmp / f"{name}.onnx",
                opset,
                attention == "fused",
                torch_dtype != torch.float32,
                external=weight_bytes > EXTERNAL_DATA_BYTES,
                rewrite=partial(quantized, name) if quantize and name in QUANTIZED_GRAPHS else None,
            )
            advance(1, f"{name}.onnx written")
        shared = share_weights(tmp, "context_kv", "decoder") if weight_bytes > EXTERNAL_DATA_BYTES else 0
        source.carry_files(tmp)
        (tmp / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2, sort_keys=True) + "\n")
        manifest = build_manifest(source, model, attention, torch_dtype, opset, tmp)
        manifest.graphs["context_kv"].weight_bytes_in_decoder_data = shared
        if quantize:
            manifest.quantization = Quantization(
                **dataclasses.asdict(quantize), matmuls=matmuls, kept=KEPT, sources=sources
            )
        unsupported = write_genai_config(tmp, manifest, model.config)
        manifest.genai = f"cannot drive these graphs: {unsupported}" if unsupported else GENAI_CONFIG
        manifest.files = sorted(p.name for p in tmp.iterdir())
        manifest.write(tmp)
    return manifest
