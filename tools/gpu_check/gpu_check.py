"""The GPU check: everything of dattn-export that only a GPU runs, measured in one command on a GPU machine as it
comes (README.md beside this file says how), results as JSON and a Markdown table under --out.

    python tools/gpu_check/gpu_check.py prepare          # here: the wheels that travel, into .gpu_check/
    python tools/gpu_check/gpu_check.py run --out DIR    # there: the check itself (a GPU)
    python tools/gpu_check/gpu_check.py dry-run --out DIR  # here: all but the GPU (the test suite runs it)

What it measures (GPU: the released models' shapes; dry run: tiny shapes through Triton's interpreter, same schema):
  kernel   the Triton kernel (torch.ops.dattn's) against the fp32 reference attention
           (modeling/attention.py) in fp32, fp16 and bf16, both merges, softcap, sliding window, the GQA ratios of
           Vidi-7B (Mistral, 32/8 heads of 128) and Vidi1.5-9B (Gemma 2, 16/8 heads of 256), contexts up to 64k
           tokens, prefill and decode: max abs error and the tolerance it meets;
  plugin   the TensorRT plugins' kernels launched as an engine launches them, without TensorRT (plugin_launch.py):
           every kernel case at the tiles `tiles` picks, and every tactic at one context, against the fp32 reference
           and timed beside the torch op and SDPA;
  models   both demo models and a model of Mistral-7B's width (2 layers), in bf16 through the reference with the
           kernel as the attention op, against the same weights' fp32 run: logits error, greedy tokens;
  bounds   what the device does at most: a bf16 matmul's rate and a copy's (deployment.py);
  speed    the kernel against PyTorch's SDPA (flash) on the equivalent conventional attention, and the wide model's
           prefill at 2k, 16k and 64k context tokens beside the matmul peak (at least 65% of it);
  decode, validate, hour   the PyTorch model as `generate --device cuda` runs it (deployment.py): decode steps
           beside the bandwidth bound, `validate --backend torch --device cuda`, an hour of video at both released
           shapes;
  tests    the test suite's kernel tests (tests/test_kernels.py, tests/test_torch_op.py, their `gpu` tests too)
           compiled on the GPU instead of interpreted: each test's outcome (the dry run collects them only);
  not_run  what cannot run there, and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import deployment

ROOT = Path(__file__).resolve().parents[2]
CARRIED = ROOT / ".gpu_check"  # the wheels that travel (git-ignored, named in the device call's carry)
CARRIED_PACKAGES = ("av",)  # what the kernel tests import (through our video decoding) that the machine lacks
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")  # the GPU machine's
# the kernel tests there: compiled, 8 at a time; not the PTX compilations, which need no GPU and run here
GPU_TESTS = ["tests/test_kernels.py", "tests/test_torch_op.py", "-k", "not ptx"]
# imported by a function of ours that the check does not call
NOT_CALLED = {
    "tensorrt": "tensorrt_plugin.register(): the check launches the plugins' kernels without TensorRT",
    "polygraphy": "polygraphy_data's saving (validate --save-polygraphy), which validate --backend torch has not",
    "compressed_tensors": "weight_check.check_compressed: verify of a quantized folder, which the check does not run",
}
CARRY_LIMIT = 64 << 20  # what travels to the GPU machine: the working tree and the carried folder together
SCHEMA = 1
# kernel vs fp32 reference, outputs O(1): as tests/test_kernels.py
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}
MODEL_TOLERANCE = 0.05  # bf16 model vs its fp32 run: max abs logits error over the largest logit
PLUGIN_SLOWER = (
    1.15  # the plugin's launch against the torch op's on the same inputs, on a GPU: at most this much slower
)
# what the GPU machines hold (their image's package list, import names) besides the standard library: the check
# imports nothing else, and carries our wheel and CARRIED_PACKAGES' (for the kernel tests)
THERE = {
    "torch", "triton", "transformers", "numpy", "safetensors", "huggingface_hub", "tokenizers", "PIL", "rich",
    "click", "onnx", "onnxruntime", "onnxscript", "onnx_ir", "yaml", "packaging", "filelock", "fsspec", "jinja2",
    "markupsafe", "sympy", "mpmath", "networkx", "typing_extensions", "regex", "requests", "tqdm", "pygments",
    "markdown_it", "mdurl", "certifi", "charset_normalizer", "idna", "urllib3", "hf_xet", "httpx", "httpcore", "h11",
    "anyio", "sniffio", "shellingham", "typer", "ml_dtypes", "google", "psutil", "annotated_doc",
}  # fmt: skip
NOT_RUN = [
    ("TensorRT engines (built with the plugins, and run)", "TensorRT is not installed there and its wheels "
     "(hundreds of MB) cannot travel: the plugins' kernels run through the CUDA driver instead (`plugin`); "
     "tests/test_trt.py's gpu tests build and run engines where TensorRT is"),
    ("ONNX Runtime's CUDA provider (--device cuda)", "onnxruntime-gpu's wheel is 255 MB, over the 64 MiB that "
     "travels; tests/test_onnx.py's gpu test runs it where onnxruntime-gpu is"),
    ("vLLM on a GPU", "vLLM is not installed there and cannot travel"),
]  # fmt: skip


DEPLOYMENT = {"cuda": deployment.GPU, "cpu": deployment.DRY}  # deployment.py's shapes, by where the check runs


@dataclass(frozen=True)
class Sizes:
    """The shapes one run measures: the released models' on a GPU, tiny ones in the dry run."""

    attention: dict  # name -> (query heads, KV heads, head dim, softcap, window, scale)
    contexts: tuple[int, ...]
    prefill_queries: int
    decode_past: int
    wide: dict  # the realistic-width model's config overrides
    prefill_contexts: tuple[int, ...]
    prompt: int
    new_tokens: int
    timing_repeats: int


GPU = Sizes(
    attention={
        "Vidi-7B (Mistral)": (32, 8, 128, 0.0, 0, 128**-0.5),
        "Vidi1.5-9B (Gemma 2)": (16, 8, 256, 50.0, 4096, 256**-0.5),
    },
    contexts=(2048, 16384, 65536),
    prefill_queries=256,
    decode_past=2048,
    wide=deployment.MISTRAL_7B | {"num_hidden_layers": 2},
    prefill_contexts=(2048, 16384, 65536),
    prompt=64,
    new_tokens=16,
    timing_repeats=20,
)
DRY = Sizes(
    attention={"tiny Mistral": (4, 2, 32, 0.0, 0, 32**-0.5), "tiny Gemma 2": (4, 1, 32, 50.0, 8, 24**-0.5)},
    contexts=(40,),
    prefill_queries=3,
    decode_past=5,
    wide=deployment.TINY,
    prefill_contexts=(64,),
    prompt=6,
    new_tokens=3,
    timing_repeats=1,
)


@dataclass
class Report:
    schema: int
    device: str
    date: str
    versions: dict
    dry_run: bool
    bounds: list[dict] = field(default_factory=list)
    kernel: list[dict] = field(default_factory=list)
    plugin: list[dict] = field(default_factory=list)
    models: list[dict] = field(default_factory=list)
    speed: list[dict] = field(default_factory=list)
    prefill: list[dict] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)
    validate: list[dict] = field(default_factory=list)
    hour: list[dict] = field(default_factory=list)
    tests: list[dict] = field(default_factory=list)
    not_run: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        gated = (self.kernel, self.plugin, self.models, self.prefill, self.decode, self.validate, self.hour, self.tests)
        return all(row["passed"] for rows in gated for row in rows)


def cases(sizes: Sizes):
    """Every kernel case: (attention name, its shape, dtype, merge and segments, context, phase, queries, past) at
    the released shapes, fp32/fp16/bf16, dattn's one softmax and the released sum over frames + audio, prefill and
    decode."""
    import torch

    for name, shape in sizes.attention.items():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for merge, segments in (("alpha", 1), ("sum", 2)):
                for context in sizes.contexts:
                    for phase, queries, past in (
                        ("prefill", sizes.prefill_queries, 0),
                        ("decode", 1, sizes.decode_past),
                    ):
                        yield name, shape, dtype, merge, segments, context, phase, queries, past


def op_inputs(shape: tuple, dtype, segments: int, context: int, queries: int, past: int, device: str, seed: int):
    """The op's eight inputs, random, contiguous, on `device`: the last third of the context the second segment (the
    audio's) when there are two, and the op's attributes for `shape`."""
    import torch

    from dattn_export.plugins.contract import Attributes

    heads, kv_heads, dim, softcap, window, scale = shape
    g = torch.Generator().manual_seed(seed)
    rand = lambda *dims: torch.randn(*dims, generator=g).to(device, dtype)
    keys = past + queries
    mask = torch.ones(1, context, dtype=torch.int32)
    mask[:, context * 2 // 3 :] = segments
    inputs = (
        rand(1, heads, queries, dim), rand(1, kv_heads, keys, dim), rand(1, kv_heads, keys, dim),
        torch.ones(1, keys, dtype=torch.bool, device=device), rand(1, heads, queries, dim),
        rand(1, kv_heads, context, dim), rand(1, kv_heads, context, dim), mask.to(device),
    )  # fmt: skip
    return inputs, lambda merge: Attributes(scale, softcap, window, merge, num_contexts=segments)


def against_reference(got, inputs, attributes, dtype) -> tuple[float, float]:
    """(max abs error of `got` against the fp32 reference on the same inputs, the tolerance it must meet)."""
    from dattn_export.plugins import contract

    expected = contract.reference(tuple(t.float() if t.is_floating_point() else t for t in inputs), attributes)
    error = (got.float() - expected).abs().max().item()
    # outputs O(1) a softmax; the sum merge adds one per segment and the text's
    return error, TOLERANCE[str(dtype).removeprefix("torch.")] * max(1.0, expected.abs().max().item())


def kernel_rows(sizes: Sizes, device: str) -> list[dict]:
    """Each case: the kernel (torch.ops.dattn's launch) on fp32/fp16/bf16 inputs against the reference on the same
    inputs in fp32 (fp32: the kernel multiplies in full precision, as PyTorch does by default; Triton's default
    would be TF32)."""
    from dattn_export.plugins.triton_kernel import launch

    rows = []
    for name, shape, dtype, merge, segments, context, phase, queries, past in cases(sizes):
        inputs, attributes = op_inputs(shape, dtype, segments, context, queries, past, device, len(rows))
        error, tolerance = against_reference(launch(*inputs, attributes(merge)), inputs, attributes(merge), dtype)
        heads, kv_heads, dim, softcap, window, _ = shape
        rows.append(dict(attention=name, dtype=str(dtype).removeprefix("torch."), merge=merge, softcap=softcap,
                         window=window, heads=heads, kv_heads=kv_heads, head_dim=dim, context=context, phase=phase,
                         queries=queries, past=past, max_abs=error, tolerance=tolerance,
                         passed=error <= tolerance))  # fmt: skip
    return rows


def sdpa_of(inputs, scale: float, context: int, past: int):
    """SDPA on the conventional attention equivalent to the op's inputs (the queries over [context ; text] keys,
    causal, K/V expanded to the query heads): what the kernel is timed beside."""
    import torch
    import torch.nn.functional as F

    q, k, v, _, _, k_vis, v_vis, _ = inputs
    heads, kv_heads, queries = q.shape[1], k.shape[1], q.shape[2]
    all_k = torch.cat([k_vis, k], 2).repeat_interleave(heads // kv_heads, 1)
    all_v = torch.cat([v_vis, v], 2).repeat_interleave(heads // kv_heads, 1)
    slots = torch.arange(all_k.shape[2], device=q.device)
    mask = slots[None, :] <= (context + past + torch.arange(queries, device=q.device))[:, None]
    return lambda: F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=mask, scale=scale)


def plugin_rows(sizes: Sizes, device: str) -> list[dict]:
    """The TensorRT plugins' kernels as an engine runs them (plugin_launch.py: the shares plugin, then the merge, each
    launched through the CUDA driver as TensorRT launches it; in the dry run, the CPU stand-in with the same
    arguments): every case at the tiles `tiles` picks, against the fp32 reference and timed beside the torch op and
    SDPA on the same inputs; then every tactic of each shape at one context (fp16, alpha). On a GPU a row passes
    within the kernel tolerance and at most PLUGIN_SLOWER x the torch op's time."""
    import torch
    from plugin_launch import DriverLauncher, interpreted, plugin_attention

    from dattn_export.plugins.tensorrt_plugin import tactics
    from dattn_export.plugins.triton_kernel import launch, tiles

    launcher = DriverLauncher() if device == "cuda" else interpreted
    phases = (("prefill", sizes.prefill_queries, 0), ("decode", 1, sizes.decode_past))
    middle = sizes.contexts[len(sizes.contexts) // 2]
    chosen_cases = [(case, None) for case in cases(sizes)]
    tactic_cases = [((name, shape, torch.float16, "alpha", 1, middle, phase, queries, past), tactic)
                    for name, shape in sizes.attention.items() for phase, queries, past in phases
                    for tactic in range(len(tactics(shape[2], 2)))]  # fmt: skip
    rows = []
    for (name, shape, dtype, merge, segments, context, phase, queries, past), tactic in chosen_cases + tactic_cases:
        inputs, attributes = op_inputs(shape, dtype, segments, context, queries, past, device, len(rows))
        element = torch.empty(0, dtype=dtype).element_size()
        listed = tactics(shape[2], element)
        tactic = listed.index(tiles(queries, shape[2], element)) if tactic is None else tactic
        op = attributes(merge)
        got, _ = plugin_attention(inputs, op, listed[tactic], launcher)
        error, tolerance = against_reference(got, inputs, op, dtype)
        repeats = sizes.timing_repeats
        plugin_ms = timed(lambda: plugin_attention(inputs, op, listed[tactic], launcher), repeats, device)  # noqa: B023
        torch_ms = timed(lambda: launch(*inputs, op), repeats, device)  # noqa: B023
        sdpa_ms = timed(sdpa_of(inputs, shape[5], context, past), repeats, device)
        fast = device != "cuda" or plugin_ms <= PLUGIN_SLOWER * torch_ms
        t = listed[tactic]
        rows.append(dict(attention=name, dtype=str(dtype).removeprefix("torch."), merge=merge, context=context,
                         phase=phase, tactic=tactic, tiles=f"{t.block_m}x{t.block_n}, {t.num_warps} warps",
                         max_abs=error, tolerance=tolerance, plugin_ms=plugin_ms, torch_op_ms=torch_ms,
                         sdpa_ms=sdpa_ms, vs_torch_op=plugin_ms / torch_ms,
                         passed=error <= tolerance and fast))  # fmt: skip
    return rows


def model_configs(sizes: Sizes) -> dict:
    from dattn_export.presets import tiny_config

    return {
        "demo (Mistral)": tiny_config("mistral"),
        "demo (Gemma 2)": tiny_config("gemma2"),
        f"Mistral, hidden {sizes.wide['hidden_size']}, {sizes.wide['num_hidden_layers']} layers": tiny_config(
            "mistral", **sizes.wide
        ),
    }


def model_rows(sizes: Sizes, device: str) -> list[dict]:
    """Each model: random weights in fp32 run through the reference, then the same weights in bf16 with the kernel
    as every attention op; logits of the prompt and greedy tokens compared."""
    import torch

    from dattn_export.modeling.modeling_dattn import MODEL_CLASSES
    from dattn_export.plugins.contract import using_op
    from dattn_export.plugins.torch_op import model_op
    from dattn_export.presets import randomize_weights

    rows = []
    for name, config in model_configs(sizes).items():
        with torch.device(device):
            model = MODEL_CLASSES[config.model_type](config)
        model = randomize_weights(model.eval(), seed=1)
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(3, config.vocab_size, (1, sizes.prompt), generator=g).to(device)
        size = config.vision_config["image_size"]
        pixels = torch.randn(1, 1, 3, size, size, generator=g).to(device)
        with torch.no_grad():
            expected = model(ids, pixels).logits.float()
            expected_tokens = model.greedy(ids, pixels, max_new_tokens=sizes.new_tokens)[0].tolist()
            model = model.to(torch.bfloat16)
            with using_op(model, model_op):
                got = model(ids, pixels.bfloat16()).logits.float()
                tokens = model.greedy(ids, pixels.bfloat16(), max_new_tokens=sizes.new_tokens)[0].tolist()
        scale = expected.abs().max().item()
        error = (got - expected).abs().max().item()
        agree = next((i for i, (a, b) in enumerate(zip(tokens, expected_tokens)) if a != b), len(tokens))
        rows.append(dict(model=name, hidden=config.hidden_size, layers=config.num_hidden_layers, dtype="bfloat16",
                         logits_max_abs=error, logits_scale=scale, relative=error / scale, tolerance=MODEL_TOLERANCE,
                         tokens_agree=agree, tokens=len(tokens), passed=error / scale <= MODEL_TOLERANCE))  # fmt: skip
        del model
    return rows


def timed(fn, repeats: int, device: str) -> float:
    """Milliseconds a call (CUDA events on a GPU; the wall clock in the dry run)."""
    import torch

    fn()
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) * 1e3 / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def conventional_case(heads: int, kv_heads: int, dim: int, queries: int, past: int, context: int, device: str,
                      scale: float):  # fmt: skip
    """Random fp16 inputs of the op (`queries` after `past` text tokens, over `context` context keys) and a call of
    SDPA on the equivalent conventional attention: the queries over [context ; text] keys with the matching causal
    mask, K/V expanded to the query heads as SDPA takes them (bench/kernel_blocks.py times the same)."""
    import torch
    import torch.nn.functional as F

    keys = past + queries
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=torch.float16)
    q, k, v = rand(1, heads, queries, dim), rand(1, kv_heads, keys, dim), rand(1, kv_heads, keys, dim)
    k_vis, v_vis = rand(1, kv_heads, context, dim), rand(1, kv_heads, context, dim)
    key_mask = torch.ones(1, keys, dtype=torch.bool, device=device)
    context_mask = torch.ones(1, context, dtype=torch.bool, device=device)
    all_k = torch.cat([k_vis, k], 2).repeat_interleave(heads // kv_heads, 1)
    all_v = torch.cat([v_vis, v], 2).repeat_interleave(heads // kv_heads, 1)
    slots = torch.arange(context + keys, device=device)
    mask = slots[None, :] <= (context + past + torch.arange(queries, device=device))[:, None]
    inputs = (q, k, v, key_mask, q, k_vis, v_vis, context_mask)
    return inputs, lambda: F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=mask, scale=scale)


def speed_rows(sizes: Sizes, device: str) -> list[dict]:
    """The kernel against SDPA on the equivalent conventional attention (`conventional_case`)."""
    from dattn_export.plugins.contract import Attributes
    from dattn_export.plugins.triton_kernel import launch

    name, (heads, kv_heads, dim, _, _, scale) = next(iter(sizes.attention.items()))
    rows = []
    for context in sizes.contexts:
        for phase, queries, past in (("prefill", sizes.prefill_queries, 0), ("decode", 1, sizes.decode_past)):
            inputs, sdpa_call = conventional_case(heads, kv_heads, dim, queries, past, context, device, scale)
            attributes = Attributes(scale)
            ours = timed(lambda: launch(*inputs, attributes), sizes.timing_repeats, device)  # noqa: B023
            sdpa = timed(sdpa_call, sizes.timing_repeats, device)
            rows.append(dict(attention=name, context=context, phase=phase, queries=queries, past=past,
                             dattn_ms=ours, sdpa_ms=sdpa, speedup=sdpa / ours))  # fmt: skip
    return rows


def prefill_rows(sizes: Sizes, device: str) -> list[dict]:
    """The wide model in bf16 with the kernel: every layer's context K/V for N context tokens (linear in N: the
    context never attends to itself), then the prompt's prefill over them."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from dattn_export.modeling.modeling_dattn import MODEL_CLASSES
    from dattn_export.plugins.contract import using_op
    from dattn_export.plugins.torch_op import model_op

    config = list(model_configs(sizes).values())[-1]
    with torch.device(device):
        model = MODEL_CLASSES[config.model_type](config).to(torch.bfloat16).eval()
    ids = torch.randint(3, config.vocab_size, (1, sizes.prompt), device=device)
    peak = deployment.bounds(device, DEPLOYMENT[device])["matmul_tflops"]
    rows = []
    with torch.no_grad(), using_op(model, model_op):
        for context in sizes.prefill_contexts:
            embeds = torch.randn(1, context, config.hidden_size, device=device, dtype=torch.bfloat16)

            def prefill():
                caches = model.model.encode_context(embeds)
                return model(ids, context_key_values=caches).logits

            ms = timed(prefill, max(1, sizes.timing_repeats // 4), device)
            with FlopCounterMode(display=False) as counter:  # the matrix products (the attention's are < 1% here)
                prefill()
            tflops = counter.get_total_flops() / ms / 1e9
            rows.append(dict(model=f"hidden {config.hidden_size}, {config.num_hidden_layers} layers",
                             context_tokens=context, prompt_tokens=sizes.prompt, ms=ms, tflops=tflops,
                             peak_tflops=peak, of_peak=tflops / peak,
                             passed=device != "cuda" or tflops >= deployment.PREFILL_SHARE * peak))  # fmt: skip
    return rows


def test_rows(sizes: Sizes, device: str) -> list[dict]:
    """GPU_TESTS run by pytest on `device` (compiled on CUDA), one row per test from its JUnit report; on the CPU
    (the dry run) collected only: the suite runs them here."""
    import tempfile
    import xml.etree.ElementTree as ElementTree
    from importlib.util import find_spec

    whole = dict(test=" ".join(GPU_TESTS), seconds=0.0, passed=False)
    if missing := [name for name in ("pytest", "xdist", "hypothesis") if find_spec(name) is None]:
        return [dict(whole, outcome=f"not run: {', '.join(missing)} missing")]
    command = [sys.executable, "-m", "pytest", *GPU_TESTS, "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    if device == "cpu":
        listed = subprocess.run([*command, "--collect-only"], cwd=ROOT, capture_output=True, text=True)
        return [dict(test=line, outcome="collected", seconds=0.0, passed=listed.returncode == 0)
                for line in listed.stdout.splitlines() if "::" in line]  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        junit = Path(folder) / "tests.xml"
        try:
            subprocess.run([*command, "-n", "8", f"--junitxml={junit}"], cwd=ROOT, timeout=600)
        except subprocess.TimeoutExpired:
            return [dict(whole, outcome="timed out after 600 s")]
        cases = list(ElementTree.parse(junit).getroot().iter("testcase")) if junit.exists() else []
    rows = []
    for case in cases:
        ended = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        outcome = "passed" if ended is None else ended.tag  # a test skipped on a GPU did not run: not a pass
        message = "" if ended is None else (ended.get("message") or "").strip().split("\n")[0][:160]
        rows.append(dict(test=f"{case.get('classname')}::{case.get('name')}", outcome=outcome,
                         seconds=float(case.get("time", 0)), message=message, passed=outcome == "passed"))  # fmt: skip
    return rows or [dict(whole, outcome="no report")]


def versions() -> dict:
    import torch
    import transformers
    import triton

    import dattn_export

    found = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                 transformers=transformers.__version__, dattn_export=dattn_export.__version__,
                 dattn_export_from=str(Path(dattn_export.__file__).parent))  # fmt: skip
    if torch.cuda.is_available():
        found["cuda"] = torch.version.cuda
    return found


def check(out: Path, dry_run: bool) -> Report:
    """The whole check: the GPU's sizes on a GPU, the dry run's through Triton's interpreter on CPU tensors."""
    import torch

    if not dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA GPU is visible: run this on a GPU machine, or `dry-run` here")
    device, sizes = ("cpu", DRY) if dry_run else ("cuda", GPU)
    name = "CPU (Triton interpreter), dry run" if dry_run else torch.cuda.get_device_name()
    report = Report(SCHEMA, name, datetime.date.today().isoformat(), versions(), dry_run)
    start = time.perf_counter()
    deploy = DEPLOYMENT[device]
    parts = (
        ("bounds", lambda _, d: deployment.bounds_rows(deploy, d)), ("kernel", kernel_rows), ("plugin", plugin_rows),
        ("models", model_rows), ("speed", speed_rows), ("prefill", prefill_rows),
        ("decode", lambda _, d: deployment.decode_rows(deploy, d)),
        ("validate", lambda sizes_, d: deployment.validate_rows(deploy, d, sizes_.wide)),
        ("hour", lambda _, d: deployment.hour_rows(deploy, d)), ("tests", test_rows),
    )  # fmt: skip
    for part, rows in parts:
        part_start = time.perf_counter()
        setattr(report, part, rows(sizes, device))
        print(f"{part}: {len(getattr(report, part))} rows, {time.perf_counter() - part_start:.1f} s", flush=True)
        write(report, out)  # what is done so far survives a run cut short
    report.not_run = [dict(what=what, why=why) for what, why in NOT_RUN]
    report.seconds = time.perf_counter() - start
    write(report, out)
    return report


def write(report: Report, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({**dataclasses.asdict(report), "passed": report.passed}, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))


def table(rows: list[dict], columns: list[str]) -> str:
    def cell(value) -> str:
        if isinstance(value, bool):
            return "yes" if value else "**NO**"
        if isinstance(value, float):
            return f"{value:.3g}"
        return str(value)

    if not rows:
        return "none"
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def markdown(report: Report) -> str:
    v = report.versions
    head = (
        f"# GPU check: {report.device}, {report.date}\n\n"
        f"torch {v['torch']}, triton {v['triton']}, transformers {v['transformers']}, python {v['python']}; "
        f"{report.seconds:.0f} s; {'every check passed' if report.passed else '**a check failed**'}\n"
    )
    sections = [
        ("Kernel against the fp32 reference", report.kernel,
         ["attention", "dtype", "merge", "context", "phase", "max_abs", "tolerance", "passed"]),
        ("The TensorRT plugins' kernels as an engine runs them (shares, then merge; ms a call)", report.plugin,
         ["attention", "dtype", "merge", "context", "phase", "tactic", "tiles", "max_abs", "tolerance", "plugin_ms",
          "torch_op_ms", "sdpa_ms", "vs_torch_op", "passed"]),
        ("Models in bf16 (kernel) against fp32 (reference)", report.models,
         ["model", "logits_max_abs", "logits_scale", "relative", "tokens_agree", "tokens", "passed"]),
        ("Kernel against SDPA (fp16, ms a call)", report.speed,
         ["attention", "context", "phase", "dattn_ms", "sdpa_ms", "speedup"]),
        ("What this device does at most (measured: the bounds below)", report.bounds,
         ["device", "matmul_tflops", "copy_gbs"]),
        ("Prefill (bf16, kernel): the rate of its matrix products beside the measured bf16 peak", report.prefill,
         ["model", "context_tokens", "prompt_tokens", "ms", "tflops", "peak_tflops", "of_peak", "passed"]),
        ("Decode (bf16, kernel, static cache, CUDA graph): ms a token beside the bandwidth bound (the bytes a step "
         "reads over the measured copy rate)", report.decode,
         ["model", "context_tokens", "ms_per_token", "bound_ms", "vs_bound", "capture_s", "passed"]),
        ("validate --backend torch --device cuda (the deployed model against its fp32 run)", report.validate,
         ["model", "dtype", "logits_max_abs", "tolerance", "tokens_agree", "tokens", "passed"]),
        ("An hour of video: generate --device cuda --video", report.hour,
         ["model", "frames", "visual_tokens", "audio_tokens", "load_s", "decode_file_s", "towers_and_context_s",
          "prompt_s", "first_token_s", "tokens_per_s", "peak_gpu_gib"]),
        (f"The kernel tests on this device: {tests_summary(report.tests)}; the ones that did not pass",
         [row for row in report.tests if not row["passed"]], ["test", "outcome", "message"]),
        ("Not run", report.not_run, ["what", "why"]),
    ]  # fmt: skip
    return head + "".join(f"\n## {title}\n\n{table(rows, columns)}\n" for title, rows, columns in sections)


def tests_summary(rows: list[dict]) -> str:
    from collections import Counter

    counts = Counter(row["outcome"] for row in rows)
    return ", ".join(f"{count} {outcome}" for outcome, count in counts.items()) or "none"


# --- here, before the device call ---------------------------------------------------------------------------------


def prepare() -> list[Path]:
    """Into CARRIED, the wheels that travel: ours, built as a release builds it (PEP 517, in an isolated
    environment), and CARRIED_PACKAGES' at the versions installed here, for the GPU machine's Python."""
    import shutil
    from importlib.metadata import version

    shutil.rmtree(CARRIED, ignore_errors=True)
    CARRIED.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(CARRIED), str(ROOT)],
                   check=True)  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version=3.12", "--implementation=cp", *(f"--platform={p}" for p in PLATFORMS),
                    "--dest", str(CARRIED), *(f"{name}=={version(name)}" for name in CARRIED_PACKAGES)],
                   check=True)  # fmt: skip
    return sorted(CARRIED.glob("*.whl"))


def travelling_bytes() -> int:
    """What a device call sends: tracked and untracked-not-ignored files, and the carried folder."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")  # fmt: skip
    files = [ROOT / name.decode() for name in listed if name] + list(CARRIED.rglob("*"))
    return sum(f.stat().st_size for f in files if f.is_file())


def wheels_install_there(wheels: list[Path]) -> str:
    """pip's answer to installing the wheels on the GPU machine's Python (3.12, x86-64, no index)."""
    target = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu-check-target"
    platforms = [f"--platform={p}" for p in (*PLATFORMS, "any")]
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index", "--only-binary=:all:",
         "--python-version=3.12", *platforms, "--target", str(target), *map(str, wheels)],
        capture_output=True, text=True,
    )  # fmt: skip
    return "" if result.returncode == 0 else (result.stderr.strip().splitlines() or ["pip failed"])[-1]


def our_imports() -> set[str]:
    """The top-level packages that the modules of ours the check loaded import (anywhere in them: a function's
    import too), read from their source."""
    import ast

    names = set()
    for module in [m for name, m in sys.modules.items() if name.startswith("dattn_export") and m is not None]:
        tree = ast.parse(Path(module.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def dry_run(out: Path) -> Report:
    """All but the GPU: the carried set's size and wheels, the check through Triton's interpreter (same schema), and
    that it imports nothing the GPU machine lacks."""
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    wheels = sorted(CARRIED.glob("*.whl")) or prepare()
    problems = []
    size = travelling_bytes()
    if size > CARRY_LIMIT:
        problems.append(f"{size / 2**20:.1f} MiB would travel: over the {CARRY_LIMIT >> 20} MiB a device call takes")
    if refused := wheels_install_there(wheels):
        problems.append(f"the carried wheels do not install on Python 3.12 x86-64: {refused}")
    report = check(out, dry_run=True)
    there = THERE | set(CARRIED_PACKAGES) | set(sys.stdlib_module_names) | {"dattn_export"} | set(NOT_CALLED)
    if foreign := sorted(our_imports() - there):
        problems.append(f"imports what the GPU machine lacks: {', '.join(foreign)}")
    summary = dict(travelling_mib=size / 2**20, wheels=[w.name for w in wheels], problems=problems)
    (out / "dry_run.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    if problems:
        sys.exit("dry run: " + "; ".join(problems))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["prepare", "run", "dry-run"])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    args = parser.parse_args()
    if args.step == "prepare":
        print("\n".join(str(w) for w in prepare()))
        return
    report = dry_run(args.out) if args.step == "dry-run" else check(args.out, dry_run=False)
    print(markdown(report))
    if not report.passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
