"""Building TensorRT engines from the exported graphs: optimization profiles from the user's limits.

Works with TensorRT or TensorRT-RTX (same Python API). TensorRT-RTX builds on a machine without a GPU,
which is how the exported graphs are checked against a real TensorRT-family ONNX parser in CI. Nothing here
creates a runtime object: engines are only built and serialized.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..dtypes import short_name
from ..errors import InputError
from ..folders import ONNX_MANIFEST
from ..modeling.streams import AUDIO, FRAMES
from ..sidefiles import read_json
from ..ui import quiet

if TYPE_CHECKING:  # the limits are checked before torch is imported: the rest imports it when it builds
    from ..artifacts import GraphValue, OnnxManifest


@dataclass(frozen=True)
class Limits:
    """Optimization-profile bounds: (min, opt, max) per dynamic axis of the exported graphs, derived from the
    shorthands (`max_*`), then set per axis where `min`, `opt` or `max` name one (trtexec's --minShapes,
    --optShapes and --maxShapes, by axis name instead of by tensor: one axis spans several graphs)."""

    max_batch: int = 1
    max_text_tokens: int = 256
    max_context_tokens: int = 2304
    max_images: int = 4
    max_tile_side: int = 6  # anyres: the most tiles in a row or a column (mm_image_grid_points)
    min: dict[str, int] = field(default_factory=dict)
    opt: dict[str, int] = field(default_factory=dict)
    max: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        axes = self.derived()
        for option, given in (("--min", self.min), ("--opt", self.opt), ("--max", self.max)):
            if unknown := sorted(set(given) - set(axes)):
                raise InputError(option, f"{', '.join(unknown)}: not an axis of the graphs (axes: {', '.join(axes)})")
        for name in {*self.min, *self.opt, *self.max}:
            low, opt, high = self.axis(name)
            if not 0 <= low <= opt <= high:
                raise InputError(f"--min/--opt/--max {name}", f"min {low} <= opt {opt} <= max {high} does not hold")

    def derived(self) -> dict[str, tuple[int, int, int]]:
        """Every axis's bounds from the shorthands alone."""
        past = (0, self.max_text_tokens // 2, self.max_text_tokens)
        text = (1, max(1, self.max_text_tokens // 4), self.max_text_tokens)
        return {
            "batch": (1, self.max_batch, self.max_batch),
            "images": (1, 1, self.max_images),
            "sequence": text,
            "past_sequence": past,
            "total_sequence": (1, text[1] + past[1], self.max_text_tokens),
            "context_sequence": (0, self.max_context_tokens // 2, self.max_context_tokens),
            # a video model's stream graphs: the runtime runs at most this many frames / 30 s chunks at once
            "frames": (1, FRAMES.parts_per_run, FRAMES.parts_per_run),
            "chunks": (1, 1, AUDIO.parts_per_run),
            # a space-to-depth pool's side in tokens: SigLIP-384 at pool 2 gives 14, and 5 at its smallest resize
            "pooled_side": (1, 14, 32),
            # an anyres model's vision graph: the tiling of one image
            "tile_rows": (1, 2, self.max_tile_side),
            "tile_columns": (1, 2, self.max_tile_side),
        }

    def axis(self, name: str) -> tuple[int, int, int]:
        axes = self.derived()
        if name not in axes:
            raise InputError(name, "is not an axis of the exported graphs (see onnx_manifest.json)")
        low, opt, high = axes[name]
        low, high = self.min.get(name, low), self.max.get(name, high)
        return low, self.opt.get(name, min(max(opt, low), high)), high  # a derived opt kept within given bounds

    def profile(self, names) -> dict[str, list[int]]:
        """(min, opt, max) of each named axis, as trt_manifest.json records them."""
        return {name: list(self.axis(name)) for name in sorted(names)}


def dynamic_axes(manifest: OnnxManifest) -> set[str]:
    return {d for graph in manifest.graphs.values() for spec in graph.inputs for d in spec.shape if isinstance(d, str)}


def profile_shapes(graph_inputs: list[GraphValue], limits: Limits) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """min/opt/max shapes for every input of one graph, as recorded in onnx_manifest.json."""
    shapes = {}
    for spec in graph_inputs:
        bounds = [(d, d, d) if isinstance(d, int) else limits.axis(d) for d in spec.shape]
        shapes[spec.name] = tuple([b[k] for b in bounds] for k in range(3))
    return shapes


def profiles(graph_inputs: list[GraphValue], limits: Limits, plugin: bool) -> list[dict]:
    """The optimization profiles of one graph's engine: the limits', and with the plugin, for a graph that takes a
    sequence (the decoder), a decode step's too (one query), so that TensorRT times the plugin's tactics (tile
    shapes) for decode steps apart from prefills and keeps the fastest of each."""
    shapes = [profile_shapes(graph_inputs, limits)]
    if plugin and any("sequence" in spec.shape for spec in graph_inputs):
        step = dataclasses.replace(limits, min={**limits.min, "sequence": 1}, opt={**limits.opt, "sequence": 1},
                                   max={**limits.max, "sequence": 1})  # fmt: skip
        shapes.append(profile_shapes(graph_inputs, step))
    return shapes


def split_key_nodes(model, dtype: str) -> int:
    """Each fused attention node of `model` (an onnx.ModelProto, changed in place) as the two split-key plugins:
    DecomposedAttentionShares (its inputs and attributes) then MergeShares (its output); plugins/tensorrt_plugin.py
    says why. Returns how many."""
    from onnx import helper

    from ..plugins import contract
    from ..plugins.tensorrt_plugin import MERGE, SHARES

    nodes, count = [], 0
    for node in model.graph.node:
        if (node.domain, node.op_type) != (contract.DOMAIN, contract.TYPE):
            nodes.append(node)
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        op = contract.from_node(node)
        shares = [f"{node.output[0]}_shares", f"{node.output[0]}_shares_lse"]
        nodes.append(helper.make_node(SHARES, list(node.input), shares, name=f"{node.name}_shares",
                                      domain=contract.DOMAIN, **attributes))  # fmt: skip
        merged = dict(num_heads=attributes["num_heads"], head_dim=attributes["head_dim"], merge=op.merge,
                      num_contexts=op.num_contexts, dtype=dtype, **contract.PLUGIN_ATTRIBUTES)  # fmt: skip
        nodes.append(helper.make_node(MERGE, shares, list(node.output), name=f"{node.name}_merge",
                                      domain=contract.DOMAIN, **merged))  # fmt: skip
        count += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return count


def build_serialized(
    trt,
    onnx_path: Path,
    graph_inputs: list[GraphValue],
    limits: Limits,
    plugin: bool = False,
    timing_cache: Path | None = None,
    dtype: str = "float32",
) -> bytes:
    """Parse one exported graph and build a serialized engine with its optimization `profiles`. With `plugin`, the
    fused nodes become the registered plugins instead of their ONNX function: each node the split-key pair
    (`split_key_nodes`), its kernels in `dtype`.

    Strongly typed: every tensor keeps the graph's own type (an fp16 export builds an fp16 engine), as TensorRT 11
    and TensorRT-RTX always build and TensorRT 10 does with the STRONGLY_TYPED flag (11 accepts and ignores it).
    TensorRT 11 removed the weak-typing flags (BuilderFlag.FP16, BF16, INT8, ...): nothing here sets one."""
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if plugin:
        if not hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):
            raise InputError(
                onnx_path, f"TensorRT {trt.__version__} cannot prefer plugins over ONNX functions (needs >= 10.15)"
            )
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    if plugin:
        import onnx

        model = onnx.load(onnx_path, load_external_data=False)  # the weights stay where they are: the parser reads them
        split_key_nodes(model, dtype)
        parsed = parser.parse(model.SerializeToString(), str(onnx_path))
    else:
        parsed = parser.parse_from_file(str(onnx_path))
    if not parsed:
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise InputError(onnx_path, f"the TensorRT ONNX parser refused it: {errors}")
    config = builder.create_builder_config()
    cache = None
    if timing_cache is not None:
        cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
    for shapes in profiles(graph_inputs, limits, plugin):
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise InputError(onnx_path, "TensorRT could not build an engine from it (see the log above)")
    if cache is not None:
        timing_cache.write_bytes(bytes(cache.serialize()))
    return bytes(engine)


def check_buildable(onnx_dir: Path, out: Path, precision: str | None) -> str:
    """What TensorRT cannot build from an export, refused in one line before TensorRT or torch is imported (the
    manifest read as plain JSON; `OnnxManifest` checks the rest when the build reads it): a decoder quantized to ONNX
    Runtime's MatMulNBits, and a `precision` (fp16, bf16) other than the graphs' own, which strongly typed engines
    keep. Returns the graphs' precision."""
    manifest = read_json(Path(onnx_dir) / ONNX_MANIFEST, "ONNX manifest")
    graphs = short_name(str(manifest.get("dtype", "")))
    if precision not in (None, graphs):
        source = (manifest.get("source") or {}).get("path", "CKPT")
        raise InputError(
            f"--{precision}",
            f"{onnx_dir} holds {manifest.get('dtype')} graphs, and TensorRT builds engines in the graphs' own types "
            f"(strongly typed; TensorRT 11 has no precision flags): export {precision} graphs with `dattn-export onnx "
            f"{source} -o onnx-{precision} --dtype {precision}`, then `dattn-export trt onnx-{precision} -o {out}`",
        )
    if manifest.get("quantization"):
        raise InputError(
            onnx_dir,
            "holds a decoder quantized to ONNX Runtime's MatMulNBits (a com.microsoft op TensorRT's parser does not "
            "read): build engines from an export without --quantize (and with --dtype fp16 for smaller weights)",
        )
    return graphs


def build_engines(
    onnx_dir: Path,
    out: Path,
    precision: str | None,
    limits: Limits,
    timing_cache: Path | None,
    force: bool,
    use_plugin: bool = True,
    progress=quiet,
) -> dict:
    """An engine per exported graph, plus trt_manifest.json. Fused attention nodes become the DecomposedAttention
    plugin, or with `use_plugin=False` their ONNX function (standard TensorRT layers). The engines' precision is
    the graphs' own (strongly typed); `precision` (fp32, fp16, bf16, or None for the graphs') must match it: an fp32
    export is not turned into an fp16 engine behind the user's back. `progress`: `ui.progress` to show the engines as
    they are built, or `ui.quiet`."""
    from ..artifacts import (
        CARRIED_FILES,
        OnnxManifest,
        TrtManifest,
        atomic_dir,
        carry_files,
        check_output,
    )
    from ..runtime.tensorrt import require_tensorrt_gpu

    manifest = OnnxManifest.read(onnx_dir, "a folder written by dattn-export onnx: build engines from one")
    check_output(out, force, [onnx_dir])
    graphs_precision = check_buildable(onnx_dir, out, precision)
    fused = use_plugin and manifest.attention.implementation == "fused"
    trt = require_tensorrt_gpu(plugin=fused)
    if fused:
        from ..plugins.tensorrt_plugin import register

        register()
    with (
        atomic_dir(out, overwrite=force, reading=[onnx_dir]) as tmp,
        progress("building engines", len(manifest.graphs), "engines") as advance,
    ):
        engines = {}
        for name, graph in manifest.graphs.items():
            advance(0, f"building {name}.engine")
            engine = build_serialized(
                trt,
                Path(onnx_dir) / graph.file,
                graph.inputs,
                limits,
                plugin=fused and graph.fused_attention_nodes > 0,
                timing_cache=timing_cache,
                dtype=manifest.dtype,
            )
            (tmp / f"{name}.engine").write_bytes(engine)
            engines[name] = f"{name}.engine"
            advance(1, f"{name}.engine built")
        carry_files(onnx_dir, tmp, (*CARRIED_FILES, "config.json"))
        fields = {f.name: getattr(manifest, f.name) for f in dataclasses.fields(OnnxManifest)}
        trt_manifest = TrtManifest(
            **fields,
            engines=engines,
            precision=graphs_precision,
            profile=limits.profile(dynamic_axes(manifest)),
            plugin=fused,
            tensorrt=trt.__version__,
        )
        trt_manifest.write(tmp)
    return trt_manifest
