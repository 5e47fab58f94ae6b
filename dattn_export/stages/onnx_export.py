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

import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import onnx
import onnx_ir as ir
import torch

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
    Wings,
    atomic_dir,
    check_output,
    dtype_name,
)
from ..checkpoints.names import audio_tower_role
from ..checkpoints.safetensors_writer import RangeCopier
from ..checkpoints.source import open_source
from ..checkpoints.weights import empty_model, parameter_bytes, stand_in
from ..errors import InputError
from ..graphs import GraphSpec, graph_specs
from ..modeling.modeling_dattn import MODEL_CLASSES
from ..modeling.streams import context_graphs
from ..onnx_weights import WRITE_CHUNK_BYTES, Weights, bind_weights, checkpoint_weights
from ..patches import errors_only, lazy_folding
from ..plugins import contract
from ..plugins.onnx_node import attach_function, fused_nodes
from ..runtime.genai import GENAI_CONFIG, write_genai_config
from ..runtime.ort import external_tensors
from ..sidefiles import read_json
from ..ui import quiet
from .onnx_quantize import KEPT, QUANTIZED_GRAPHS, quantize_graph, quantized_bytes

DEFAULT_OPSET = 18  # accepted by TensorRT 10/11's ONNX parsers and ONNX Runtime
SUPPORTED_OPSETS = range(18, 24)
MAX_IR_VERSION = 10  # ONNX Runtime 1.31 reads up to 13; 10 is what opset 18-23 models need
EXTERNAL_DATA_BYTES = 64 << 20  # models with more weights keep them in .data files: never re-serialized in memory


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
    SimplifiedLayerNormalization kernel: 6 fewer nodes a norm. The same value to within rounding."""
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
