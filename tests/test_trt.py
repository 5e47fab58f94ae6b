"""TensorRT: the plugin's TensorRT-free parts on CPU; engines, TRT-vs-PyTorch and timings on a GPU only."""

import importlib.util
import itertools
import subprocess
import sys

import pytest
import torch
from helpers.cli import run_cli

from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.plugins import contract
from dattn_export.plugins.contract import Attributes
from dattn_export.plugins.tensorrt_plugin import signature
from dattn_export.plugins.triton_kernel import int_arguments, launch_grid
from dattn_export.stages.onnx_export import export_onnx

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None
gpu = pytest.mark.skipif(
    not (HAVE_TENSORRT and torch.cuda.is_available()), reason="needs TensorRT (NVIDIA's wheels) and an NVIDIA GPU"
)


def test_attributes_are_checked():
    Attributes(0.088, 50.0, 4096, "alpha", 0)
    contract.check_shapes(8, 2, 128)
    for bad in (dict(merge="max"), dict(window=-1), dict(scale=0.0)):
        with pytest.raises(ValueError, match="dattn::DecomposedAttention"):
            Attributes(**{"scale": 0.088, **bad})
    for heads, kv_heads, head_dim in ((8, 2, 96), (8, 3, 128)):
        with pytest.raises(ValueError, match="dattn::DecomposedAttention"):
            contract.check_shapes(heads, kv_heads, head_dim)


def test_plugin_signature_follows_tensorrt_plugin_rules():
    """What tensorrt.plugin's register() checks of a signature (read from its _validate.py): every parameter
    annotated with a class, the TensorDescs first, attributes of serializable builtin types after, no defaults,
    a return annotation; and the names are the contract's."""
    import inspect

    class TensorDesc:  # stands in for tensorrt.plugin.TensorDesc
        pass

    sig = signature(TensorDesc, tuple[TensorDesc])
    params = list(sig.parameters.values())
    assert [p.name for p in params] == [*contract.INPUTS, *contract.SHAPE_ATTRIBUTES, *Attributes.names()]
    assert all(p.annotation is TensorDesc for p in params[: len(contract.INPUTS)])
    assert all(p.annotation in (int, float, str) for p in params[len(contract.INPUTS) :])
    assert all(p.default is inspect.Parameter.empty for p in params) and sig.return_annotation == tuple[TensorDesc]


def test_launch_grid_and_scalar_arguments():
    assert launch_grid((3, 8, 17, 64), (3, 2, 40, 64)) == (5, 6)  # 17 queries x 4 heads of a kv head: 68 rows
    # the strides the kernel gets equal those of contiguous tensors of these shapes
    q, k, kv = torch.empty(3, 8, 17, 64), torch.empty(3, 2, 40, 64), torch.empty(3, 2, 576, 64)
    expected = [8, 4, 17, 40, 576, *q.stride()[:3], *k.stride()[:3], *kv.stride()[:3]]
    assert int_arguments(q.shape, k.shape, kv.shape) == expected


@pytest.mark.slow
def test_trt_command_says_what_is_missing(pipeline, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dattn_export", "trt", pipeline / "onnx", "-o", tmp_path / "engines"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if HAVE_TENSORRT and torch.cuda.is_available():
        pytest.skip("TensorRT and a GPU are present: nothing is missing")
    # a missing TensorRT or GPU is the environment's, not the input's
    assert result.returncode == 3 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "tensorrt" in result.stderr.lower() or "no CUDA GPU" in result.stderr
    assert not (tmp_path / "engines").exists()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_engines_match_pytorch_with_plugin_and_with_function(tmp_path, family):
    """Engines with the plugin and engines with the ONNX function fallback both validate against PyTorch, and
    `generate --backend trt` gives the reference's tokens."""
    from dattn_export.demo_model import DEMO_QUESTIONS
    from dattn_export.media_options import Media
    from dattn_export.prompts import Prompt
    from dattn_export.stages.generate import run_prompt, run_prompt_graphs
    from dattn_export.stages.trt_build import Limits, build_engines
    from dattn_export.stages.validate import validate

    checkpoint = write_demo_checkpoint(tmp_path / "ckpt", family)
    export_onnx(checkpoint, tmp_path / "onnx")
    limits = Limits(max_batch=2, max_text_tokens=128, max_context_tokens=64)
    for name, use_plugin in (("plugin", True), ("function", False)):
        manifest = build_engines(tmp_path / "onnx", tmp_path / name, None, limits, None, False, use_plugin=use_plugin)
        assert manifest["plugin"] is use_plugin
        report = validate(tmp_path / name, checkpoint, backend="trt", steps=10)
        assert report.passed, report.to_json()
        media = Media(images=[checkpoint / "demo.png"])
        question = Prompt(DEMO_QUESTIONS["image"])
        generated = run_prompt_graphs(tmp_path / name, question, media, 8, "trt").generated_ids
        assert generated == run_prompt(checkpoint, question, media, 8).generated_ids


def test_min_opt_max_set_named_axes_over_the_shorthands(tmp_path):
    """--min/--opt/--max AXIS=N set one axis's profile bounds (as trtexec's --minShapes/--optShapes/--maxShapes
    do per tensor); a derived optimum stays within bounds the user gave; impossible bounds and unknown axes are one
    line each, before TensorRT is needed."""
    from dattn_export.artifacts import GraphValue
    from dattn_export.errors import InputError
    from dattn_export.stages.trt_build import Limits, profile_shapes

    limits = Limits(max_batch=4, min={"sequence": 2}, opt={"sequence": 8}, max={"context_sequence": 100, "images": 2})
    assert limits.axis("sequence") == (2, 8, 256)
    assert limits.axis("context_sequence") == (0, 100, 100)  # the shorthand's optimum (1152) clamped to the max
    assert limits.axis("batch") == (1, 4, 4) and limits.axis("images") == (1, 1, 2)
    shapes = profile_shapes([GraphValue("input_ids", "int64", ["batch", "sequence"])], limits)
    assert shapes["input_ids"] == ([1, 2], [4, 8], [4, 256])
    assert limits.profile({"batch", "sequence"}) == {"batch": [1, 4, 4], "sequence": [2, 8, 256]}
    with pytest.raises(InputError, match=r"--max: seq: not an axis of the graphs \(axes: batch, images, sequence"):
        Limits(max={"seq": 4})
    with pytest.raises(InputError, match="sequence: min 300 <= opt 256 <= max 256 does not hold"):
        Limits(min={"sequence": 300})

    onnx = tmp_path / "onnx"
    onnx.mkdir()
    (onnx / "onnx_manifest.json").write_text("{}")
    for option, expected in (("batch", "'batch' is not AXIS=N"), ("frames=0", "min 1 <= opt 0")):
        result = subprocess.run(
            [sys.executable, "-m", "dattn_export", "trt", onnx, "-o", tmp_path / "e", "--opt", option],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 2 and expected in result.stderr, result.stderr


@pytest.mark.slow
def test_fp16_and_bf16_ask_for_an_export_of_that_type(pipeline, tmp_path):
    """TensorRT 11 builds strongly typed engines only: --fp16/--bf16 cannot cast an fp32 export's engines. A mismatch
    is one line naming the export command that makes the right graphs, before TensorRT is needed; an export of the
    asked type is taken (here it goes on to need TensorRT, which this machine lacks)."""
    from dattn_export.errors import EnvironmentFailure, InputError
    from dattn_export.stages.trt_build import Limits, build_engines

    onnx = pipeline / "onnx"  # an fp32 export
    for precision in ("fp16", "bf16"):
        with pytest.raises(InputError, match=f"holds float32 graphs.*--dtype {precision}`, then `dattn-export trt"):
            build_engines(onnx, tmp_path / "engines", precision, Limits(), None, False)
        result = run_cli("trt", onnx, "-o", tmp_path / "engines", f"--{precision}")  # before TensorRT
        (line,) = result.stderr.strip().splitlines()
        assert result.returncode == 2 and f"--{precision}: " in line and "--dtype" in line, result.stderr
    if not HAVE_TENSORRT:
        with pytest.raises(EnvironmentFailure, match="tensorrt: is not installed"):
            build_engines(onnx, tmp_path / "engines", "fp32", Limits(), None, False)
    assert not (tmp_path / "engines").exists()


def plugin_launch():
    """tools/gpu_check/plugin_launch.py: the GPU check's launch of the plugins' kernels as TensorRT launches them."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "gpu_check"))
    try:
        import plugin_launch as module
    finally:
        sys.path.pop(0)
    return module


TACTIC_CASES = [  # (dtype, head dim): every tactic of both head-dim classes, every float type
    (torch.float32, 32), (torch.float16, 32), (torch.bfloat16, 32), (torch.float16, 256),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("dtype, head_dim", TACTIC_CASES)
def test_every_tactic_runs_as_an_engine_runs_it(dtype, head_dim):
    """Each tactic's kernels through Triton's interpreter at their own tiles, with the arguments TensorRT passes in
    its order (the plugins' ahead-of-time functions on concrete shapes; tools/gpu_check/plugin_launch.py's CPU
    stand-in of the driver launch): the shares plugin, then the merge, equal the reference. A decode step (its keys
    in shares, some empty) and a prefill, both merges, soft-capped and windowed, GQA 4."""
    pytest.importorskip("triton", reason="triton is not installed")
    from dattn_export.plugins.tensorrt_plugin import tactics

    launch = plugin_launch()
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    listed = tactics(head_dim, torch.empty(0, dtype=dtype).element_size())
    for tactic, (queries, past, context), merge in itertools.product(
        range(len(listed)), [(1, 2100, 1500), (20, 0, 37)], ["alpha", "sum"]
    ):
        g = torch.Generator().manual_seed(tactic)
        rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
        keys = past + queries
        segments = torch.ones(1, context, dtype=torch.int32)
        segments[:, context * 2 // 3 :] = 2 if merge == "sum" else 1
        inputs = (rand(1, 8, queries, head_dim), rand(1, 2, keys, head_dim), rand(1, 2, keys, head_dim),
                  torch.ones(1, keys, dtype=torch.bool), rand(1, 8, queries, head_dim), rand(1, 2, context, head_dim),
                  rand(1, 2, context, head_dim), segments)  # fmt: skip
        attributes = Attributes(head_dim**-0.5, 30.0, 512, merge, num_contexts=2 if merge == "sum" else 1)
        got, (shares, merged) = launch.plugin_attention(inputs, attributes, listed[tactic], launch.interpreted)
        assert shares.grid[2] == (3 if queries == 1 else 1)  # 3600 keys in 3 shares; a prefill's in one
        expected = contract.reference(tuple(t.float() if t.is_floating_point() else t for t in inputs), attributes)
        error = (got.float() - expected).abs().max().item()
        assert error <= tolerance * max(1.0, expected.abs().max().item()), (tactic, queries, merge, error)


def test_split_key_nodes_rewrite_each_fused_node_as_the_two_plugins(tmp_path):
    """`trt` with the plugin builds each fused node as DecomposedAttentionShares then MergeShares (the plugins a
    TensorRT parser maps them to, by name, namespace and version), the rest of the graph untouched."""
    import onnx

    from dattn_export.plugins.tensorrt_plugin import MERGE, SHARES
    from dattn_export.stages.trt_build import split_key_nodes

    export_onnx(write_demo_checkpoint(tmp_path / "ckpt", "gemma2"), tmp_path / "onnx")
    model = onnx.load(tmp_path / "onnx" / "decoder.onnx")
    fused = [n for n in model.graph.node if n.op_type == contract.TYPE]
    others = [n.op_type for n in model.graph.node if n.op_type != contract.TYPE]
    assert split_key_nodes(model, "float16") == len(fused) > 0
    ops = [n.op_type for n in model.graph.node]
    assert ops.count(SHARES) == ops.count(MERGE) == len(fused) and contract.TYPE not in ops
    assert [op for op in ops if op not in (SHARES, MERGE)] == others
    for node, shares, merge in zip(fused, *(nodes_of(model, op) for op in (SHARES, MERGE))):
        values = lambda n: {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert list(shares.input) == list(node.input) and values(shares) == values(node)
        assert list(merge.input) == list(shares.output) and list(merge.output) == list(node.output)
        attributes = values(merge)
        assert attributes["dtype"] == b"float16" and attributes["plugin_namespace"] == b"dattn"
        assert attributes["merge"] == values(node)["merge"] and attributes["num_heads"] == values(node)["num_heads"]
        assert shares.domain == merge.domain == contract.DOMAIN


def nodes_of(model, op_type: str) -> list:
    return [n for n in model.graph.node if n.op_type == op_type]


def test_the_plugins_decoder_has_a_decode_step_profile():
    """With the plugin, the decoder's engine has a second profile of one query a step, so that TensorRT keeps the
    fastest tactic for decode steps apart from prefills; a graph without a sequence gets one profile."""
    from dattn_export.artifacts import GraphValue
    from dattn_export.stages.trt_build import Limits, profiles

    decoder = [GraphValue("input_ids", "int64", ["batch", "sequence"]),
               GraphValue("past_key_values.0.key", "float16", ["batch", 2, "past_sequence", 32])]  # fmt: skip
    limits = Limits(max_batch=2, max_text_tokens=256)
    prefill, step = profiles(decoder, limits, plugin=True)
    assert prefill["input_ids"] == ([1, 1], [2, 64], [2, 256]) and step["input_ids"] == ([1, 1], [2, 1], [2, 1])
    assert step["past_key_values.0.key"] == prefill["past_key_values.0.key"]
    assert len(profiles(decoder, limits, plugin=False)) == 1
    vision = [GraphValue("pixel_values", "float16", ["batch", "images", 3, 32, 32])]
    assert len(profiles(vision, limits, plugin=True)) == 1
