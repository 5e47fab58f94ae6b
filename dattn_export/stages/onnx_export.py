"""`onnx`: the three graphs a deployment needs, with one fused attention node per decoder layer.

  vision.onnx     pixel_values (B, images, 3, H, W) -> visual_embeds (B, V, hidden), visual_attention_mask (B, V)
  visual_kv.onnx  visual_embeds, visual_attention_mask -> visual_key_values.{i}.key/.value (B, Hkv, V, D):
                  the visual stream, once per image, position-free, cacheable
  decoder.onnx    input_ids, position_ids, attention_mask (B, past + T), visual_attention_mask,
                  past_key_values.{i}.key/.value, visual_key_values.{i}.key/.value
                  -> logits, present.{i}.key/.value; one graph for prefill and decode
A layer with WINGS learners also caches `.wings_key/.wings_value` (B, hidden / D, S, D) in each of these.

A video model (mm_input_type "video") has two context streams, frames and audio, each run through its own graph
in parts (so memory does not grow with the length), then through visual_kv, and laid end to end as the decoder's
context, `visual_attention_mask` giving each key its stream (1 frames, 2 audio, 0 none):
  vision.onnx     pixel_values (N, 3, H, W) frames, frame_index (N,), num_frames () -> visual_embeds (1, N * t, hidden)
  audio.onnx      input_features (C, mel bins, chunk frames) 30 s chunks, first_chunk (), mel_frames () ->
                  audio_embeds (1, C * a, hidden), audio_attention_mask (1, C * a): tokens within the sample

With `--attention fused` every attention is one `dattn::DecomposedAttention` node (attributes: heads, KV
heads, head dim, scale, soft-cap, window, merge, TensorRT plugin namespace/version) with a model-local
function of standard ops attached; with `standard` the reference math is exported as plain ONNX ops.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from contextlib import nullcontext
from pathlib import Path

import onnx
import torch
from torch import nn
from torch.export import Dim

from .. import __version__
from ..artifacts import (
    DTYPES,
    AttentionExport,
    ExportedModel,
    ExportSource,
    Graph,
    GraphValue,
    OnnxManifest,
    Tool,
    Wings,
    atomic_dir,
    check_output,
    dtype_name,
)
from ..checkpoints.names import audio_tower_role
from ..checkpoints.source import build_model, open_source
from ..errors import InputError
from ..modeling.modeling_dattn import FramePool
from ..plugins import contract
from ..plugins.onnx_node import attach_function, fused_nodes
from ..runtime.genai import GENAI_CONFIG, write_genai_config
from ..sidefiles import read_json
from .quantize import SCHEMES, quantize_decoder

DEFAULT_OPSET = 18  # accepted by TensorRT 10/11's ONNX parsers and ONNX Runtime
SUPPORTED_OPSETS = range(18, 24)
MAX_IR_VERSION = 10  # ONNX Runtime 1.31 reads up to 13; 10 is what opset 18-23 models need
EXTERNAL_DATA_BYTES = 64 << 20  # models with more weights keep them in .data files: never re-serialized in memory


def kv_names(prefix: str, config) -> list[str]:
    return [f"{prefix}.{i}.{part}" for i in range(config.num_hidden_layers) for part in config.cache_parts(i)]


def layer_caches(flat: list, config) -> list[tuple]:
    """A graph's flat cache tensors, in `kv_names` order, as the model's per-layer tuples."""
    caches, start = [], 0
    for i in range(config.num_hidden_layers):
        end = start + len(config.cache_parts(i))
        caches.append(tuple(flat[start:end]))
        start = end
    return caches


class VisionGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model.model.embed_images(pixel_values), self.model.model.image_mask(pixel_values).long()


class StreamGraph(nn.Module):
    """One of the model's methods that embed (part of) one sample's context stream: frame_stream, audio_stream,
    anyres_stream."""

    def __init__(self, model, method: str):
        super().__init__()
        self.model, self.method = model, method

    def forward(self, *inputs):
        return getattr(self.model.model, self.method)(*inputs)


class VisualKVGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, visual_embeds, visual_attention_mask):
        return [t for layer in self.model.model.encode_visual(visual_embeds, visual_attention_mask) for t in layer]


class DecoderGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, visual_attention_mask, past, visual):
        config = self.model.config
        out = self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=layer_caches(past, config),
            visual_key_values=layer_caches(visual, config),
            visual_mask=visual_attention_mask,
        )
        return out.logits, [t for layer in out.past_key_values for t in layer]


def graph_specs(model, dtype: torch.dtype) -> dict:
    """Per graph: module, example inputs (no axis of size 0 or 1: the exporter would specialise it),
    dynamic axes, input and output names."""
    config = model.config
    heads = {"key": config.num_key_value_heads, "value": config.num_key_value_heads}
    heads |= {"wings_key": config.wings_heads, "wings_value": config.wings_heads}
    size, per_image = config.vision_config["image_size"], config.tokens_per_image
    batch, images, seq, past, total, visual = (
        Dim(n) for n in ("batch", "images", "sequence", "past_sequence", "total_sequence", "visual_sequence")
    )
    b, t, p, n_img = 2, 3, 4, 2
    v = n_img * per_image
    parts = [part for i in range(config.num_hidden_layers) for part in config.cache_parts(i)]
    kv = lambda n: [torch.randn(b, heads[part], n, config.head_dim, dtype=dtype) for part in parts]  # noqa: E731
    if config.is_video:
        streams = video_specs(model, dtype)
    elif config.is_anyres:
        streams = {"vision": anyres_spec(model, dtype)}
    else:
        streams = {
            "vision": dict(
                module=VisionGraph(model),
                args=(torch.randn(b, n_img, 3, size, size, dtype=dtype),),
                dynamic=({0: batch, 1: images},),
                inputs=["pixel_values"],
                outputs=["visual_embeds", "visual_attention_mask"],
            ),
        }
    return streams | {
        "visual_kv": dict(
            module=VisualKVGraph(model),
            args=(torch.randn(b, v, config.hidden_size, dtype=dtype), torch.ones(b, v, dtype=torch.int64)),
            dynamic=({0: batch, 1: visual}, {0: batch, 1: visual}),
            inputs=["visual_embeds", "visual_attention_mask"],
            outputs=kv_names("visual_key_values", config),
        ),
        "decoder": dict(
            module=DecoderGraph(model),
            args=(
                torch.randint(3, config.vocab_size, (b, t)),
                torch.arange(p, p + t).expand(b, -1),
                torch.ones(b, p + t, dtype=torch.int64),
                torch.ones(b, v, dtype=torch.int64),
                kv(p),
                kv(v),
            ),
            dynamic=(
                {0: batch, 1: seq},
                {0: batch, 1: seq},
                {0: batch, 1: total},
                {0: batch, 1: visual},
                [{0: batch, 2: past}] * len(parts),
                [{0: batch, 2: visual}] * len(parts),
            ),
            inputs=[
                "input_ids",
                "position_ids",
                "attention_mask",
                "visual_attention_mask",
                *kv_names("past_key_values", config),
                *kv_names("visual_key_values", config),
            ],
            outputs=["logits", *kv_names("present", config)],
        ),
    }


def anyres_spec(model, dtype: torch.dtype) -> dict:
    """An anyres model's vision graph: one image's thumbnail and its tiles, rows x columns of them."""
    size = model.config.vision_config["image_size"]
    return dict(
        module=StreamGraph(model, "anyres_stream"),
        args=(torch.randn(1, 3, size, size, dtype=dtype), torch.randn(2, 3, 3, size, size, dtype=dtype)),
        dynamic=((None, {0: Dim("tile_rows"), 1: Dim("tile_columns")}),),
        inputs=["thumbnail", "tiles"],
        outputs=["visual_embeds"],
    )


def video_specs(model, dtype: torch.dtype) -> dict:
    """A video model's stream graphs: frames and audio, each taking part of one sample's stream."""
    config = model.config
    size, audio = config.vision_config["image_size"], config.audio_config
    chunk_frames = 2 * audio["max_source_positions"]  # Whisper's 30 s of log-mel frames
    frames, chunks = Dim("frames"), Dim("chunks")
    scalar = lambda n: torch.tensor(n)  # noqa: E731
    return {
        "vision": dict(
            module=StreamGraph(model, "frame_stream"),
            args=(torch.randn(3, 3, size, size, dtype=dtype), torch.arange(2, 5), scalar(9)),
            dynamic=(({0: frames}, {0: frames}, None),),  # the graph module's *inputs
            inputs=["pixel_values", "frame_index", "num_frames"],
            outputs=["visual_embeds"],
        ),
        "audio": dict(
            module=StreamGraph(model, "audio_stream"),
            args=(
                torch.randn(2, audio["num_mel_bins"], chunk_frames, dtype=dtype),
                scalar(1),
                scalar(3 * chunk_frames),
            ),
            dynamic=(({0: chunks}, None, None),),
            inputs=["input_features", "first_chunk", "mel_frames"],
            outputs=["audio_embeds", "audio_attention_mask"],
        ),
    }


def export_graph(spec: dict, path: Path, opset: int, fused: bool, low_precision: bool, external: bool) -> None:
    """Export one graph. Weights always stream to a .data file first, so only the small graph proto is ever edited
    and checked in memory (the weights are never held twice); small graphs are then made single-file."""
    with torch.no_grad(), warnings.catch_warnings(), fused_nodes(spec["module"]) if fused else nullcontext():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            spec["module"],
            spec["args"],
            dynamic_shapes=spec["dynamic"],
            input_names=spec["inputs"],
            output_names=spec["outputs"],
            dynamo=True,
            opset_version=opset,
            verbose=False,
        )
        program.save(path, external_data=True)
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
    for name in ("vision", "audio", "visual_kv", "decoder") if config.is_video else ("vision", "visual_kv", "decoder"):
        graph = onnx.load(out / f"{name}.onnx", load_external_data=False).graph
        fused = sum(1 for n in graph.node if n.domain == contract.DOMAIN)
        graphs[name] = Graph(f"{name}.onnx", fused, describe_values(graph.input), describe_values(graph.output))
    generation = out / "generation_config.json"
    op = {"domain": contract.DOMAIN, "type": contract.TYPE, "version": contract.VERSION, **contract.PLUGIN_ATTRIBUTES}
    return OnnxManifest(
        format="dattn-export-onnx/1",
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
            visual_tokens_per_image=config.tokens_per_image,
            text_positions="text tokens only" if config.use_debias else "after the visual tokens",
            wings=Wings(config.wings_rank, config.wings_layer_indices, config.wings_heads)
            if config.wings_rank
            else None,
            audio_tower=None if config.audio_config is None else audio_tower_role(config),
            input_type=config.mm_input_type,
            num_contexts=config.num_contexts,
            visual_tokens_per_frame=config.tokens_per_frame if config.is_video else None,
            max_video_frames=FramePool.max_frames(config) if config.is_video else None,
            mel_frames_per_audio_token=config.mel_frames_per_audio_token if config.is_video else None,
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
    on_graph=None,
    quantize: str | None = None,
    block_size: int = 32,
    symmetric: bool = True,
    quantize_lm_head: bool = False,
    accuracy_level: int = 4,
    quantize_embedding: bool = False,
) -> OnnxManifest:
    """`quantize` (int4 | int8): decoder.onnx's MatMuls weight-only quantized by ONNX Runtime's quantizer."""
    if opset not in SUPPORTED_OPSETS:
        raise InputError(
            "--opset", f"{opset} is not supported (choose {SUPPORTED_OPSETS.start}-{SUPPORTED_OPSETS.stop - 1})"
        )
    if quantize and (quantize not in SCHEMES or dtype != "fp32"):
        raise InputError("--quantize", f"{quantize}: int4 or int8 weights of an fp32 export (--dtype fp32)")
    if dtype == "bf16" and opset < 22:
        raise InputError(
            "--dtype bf16", f"needs --opset 22 or later: ONNX's Conv accepts bfloat16 from opset 22 (asked {opset})"
        )
    source = open_source(checkpoint, base, vision_heads)
    check_output(out, force, source.inputs())
    source.carried()
    config = source.config
    if config.is_video and config.audio_config["max_source_positions"] % config.mm_audio_pool_size:
        positions = config.audio_config["max_source_positions"]
        raise InputError(
            source.config_path,
            f"mm_audio_pool_size {config.mm_audio_pool_size} does not divide the {positions} encoder positions of a "
            "30 s chunk: audio.onnx pools chunk by chunk",
        )
    torch_dtype = DTYPES[dtype].torch
    model = build_model(source, torch_dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    specs = graph_specs(model, torch_dtype)
    # the layers' weights are in visual_kv.onnx and in decoder.onnx
    with atomic_dir(out, overwrite=force, reading=source.inputs(), needed=2 * weight_bytes) as tmp:
        for name, spec in specs.items():
            export_graph(
                spec,
                tmp / f"{name}.onnx",
                opset,
                attention == "fused",
                torch_dtype != torch.float32,
                external=weight_bytes > EXTERNAL_DATA_BYTES,
            )
            if on_graph:
                on_graph(name)
        quantization = None
        if quantize:
            quantization = quantize_decoder(
                tmp / "decoder.onnx",
                quantize,
                block_size,
                symmetric,
                quantize_lm_head,
                model.config.hidden_size,
                model.config.vocab_size,
                external=weight_bytes > EXTERNAL_DATA_BYTES,
                accuracy_level=accuracy_level,
                embedding=quantize_embedding,
            )
        source.carry_files(tmp)
        (tmp / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2, sort_keys=True) + "\n")
        manifest = build_manifest(source, model, attention, torch_dtype, opset, tmp)
        manifest.quantization = None if quantization is None else dataclasses.asdict(quantization)
        unsupported = write_genai_config(tmp, manifest, model.config)
        manifest.genai = f"cannot drive these graphs: {unsupported}" if unsupported else GENAI_CONFIG
        manifest.files = sorted(p.name for p in tmp.iterdir())
        manifest.write(tmp)
    return manifest
