"""The CLI as a user runs it: real subprocesses, exit codes, one-line errors."""

import json
import os
import re
import shutil
import subprocess
import sys

import click
import pytest
import torch
from helpers.builders import picture_pixels
from helpers.checks import released_question_ids
from helpers.cli import error_line, fork_server, run_cli, run_fresh
from safetensors.torch import load_file, save_file

from dattn_export import __version__
from dattn_export.answers import seconds_ranges
from dattn_export.checkpoints.source import load_model
from dattn_export.demo_model import DEMO_QUESTIONS, write_demo_checkpoint
from dattn_export.demo_retrieval import ANSWER_TOKENS, demo_queries
from dattn_export.media_options import Media
from dattn_export.memory import MEMORY_ENV
from dattn_export.modeling.families import FAMILIES
from dattn_export.processing import load_tokenizer
from dattn_export.prompts import Prompt
from dattn_export.stages.generate import run_prompts
from dattn_export.stages.retrieve import retrieve
from dattn_export.stages.score import score


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "checkpoint")


def test_choice_lists_are_the_presets_and_the_dtype_table():
    from dattn_export import cli, dtypes
    from dattn_export.artifacts import DTYPES
    from dattn_export.modeling.families import FAMILIES

    assert cli.FAMILIES == tuple(FAMILIES)
    dtype_choices = [p.type.choices for c in cli.main.commands.values() for p in c.params if p.name == "dtype"]
    assert len(dtype_choices) == 2 and all(set(choices) - {"auto"} == set(DTYPES) for choices in dtype_choices)
    # the light name table (read before torch is imported) names the same types
    assert {short: str(d.torch).removeprefix("torch.") for short, d in DTYPES.items()} == dtypes.TORCH_NAMES
    assert all(dtypes.short_name(alias) in DTYPES for alias in dtypes.ALIASES) and dtypes.short_name("HALF") == "fp16"


@pytest.mark.slow
def test_debug_switch_shows_the_traceback(tmp_path):
    (tmp_path / "empty").mkdir()
    plain = run_cli("info", tmp_path / "empty")
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and "is an empty folder" in plain.stderr
    debug = subprocess.run(
        [sys.executable, "-m", "dattn_export", "info", str(tmp_path / "empty")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DATTN_DEBUG": "1"},
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "InputError" in debug.stderr


def test_a_forked_command_is_a_fresh_one(demo_checkpoint, tmp_path):
    """The tests' commands fork from a process that has imported torch and transformers (helpers/cli_forkserver.py):
    what each prints and returns is what `python -m dattn_export` started fresh prints and returns."""
    assert fork_server().ready, "the fork server did not start, or its imports printed something"
    for args in (["info", demo_checkpoint], ["info", tmp_path / "missing"], ["convert", demo_checkpoint]):
        forked, fresh = run_cli(*args, cwd=tmp_path), run_fresh(*args, cwd=tmp_path)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    # what a command reads as it runs (a memory limit) is set in its child alone: refused under it, then verified
    assert run_cli("convert", demo_checkpoint, "-o", tmp_path / "out").returncode == 0
    limited = os.environ | {MEMORY_ENV: "0.001"}
    forked, fresh = (run("verify", tmp_path / "out", env=limited) for run in (run_cli, run_fresh))
    # stderr's progress lines before the error carry rates, which differ from run to run: the error line is compared
    assert forked.returncode == fresh.returncode == 3 and forked.stdout == fresh.stdout
    assert error_line(forked.stderr) == error_line(fresh.stderr) and "Error: memory: " in error_line(forked.stderr)
    assert run_cli("verify", tmp_path / "out").returncode == 0


def test_version_and_help():
    result = run_cli("--version")
    assert result.returncode == 0 and __version__ in result.stdout
    result = run_cli("--help")
    assert result.returncode == 0 and "demo" in result.stdout and "generate" in result.stdout


@pytest.mark.slow
def test_demo_end_to_end(pipeline):
    """`dattn-export demo`, as the README's set-up line runs it: its answer is what the library computes from the
    checkpoint it wrote, which is sharded like a real training output, with nothing left half-written."""
    output = (pipeline / "commands" / "setup" / "0.out").read_text()  # the README's set-up line ends with the demo
    assert "validation passed" in output, output
    generated = json.loads(re.search(r"generated ids \(\d+\): (\[.*\])", output).group(1))
    # recompute in-process from the written checkpoint with the library calls the user would make
    checkpoint = pipeline / "dattn-demo" / "checkpoint"
    model = load_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint, model.config)
    pixels = picture_pixels(checkpoint / "demo.png", model.config, checkpoint)
    ids = torch.tensor([released_question_ids(tokenizer, model.config.family.name, DEMO_QUESTIONS["image"])])
    expected = model.greedy(ids, pixels, torch.ones_like(ids), max_new_tokens=12, eos_token_id=2)
    assert generated == expected[0].tolist()
    assert len(list(checkpoint.glob("model-*-of-*.safetensors"))) > 1  # sharded like a real training output
    assert not list((pipeline / "dattn-demo").glob(".checkpoint.partial-*"))


@pytest.mark.slow
def test_video_demo_end_to_end(tmp_path):
    """demo --input video: the video model trained to retrieve (released layout) asked the queries of a held-out
    clip with sound through generate (frames and sound track decoded from the file), convert + verify, the
    four ONNX graphs + validate; the tokens equal the library's from the same file, and answers' ranges overlap
    the truth. On the held-out split the export on ONNX Runtime answers every query as the converted folder does in
    PyTorch, and finds the seconds far better than the same model untrained."""
    out = tmp_path / "out"
    result = run_cli("demo", out, "--input", "video", "--family", "gemma2")
    assert result.returncode == 0, result.stderr
    assert "validation passed" in result.stdout
    generated = json.loads(re.search(r"generated ids \(\d+\): (\[.*\])", result.stdout).group(1))
    checkpoint, asked = out / "checkpoint", demo_queries()
    video = Media(video=checkpoint / "demo.mov")
    answers = run_prompts(checkpoint, [Prompt(q.query, "query") for q in asked], video, ANSWER_TOKENS).results
    assert generated == answers[0].generated_ids
    assert answers[0].visual_tokens == asked[0].duration * 16  # a frame a second, 4 x 4 tokens each
    found = [seconds_ranges(answer.text, q.duration, FAMILIES["gemma2"]) for q, answer in zip(asked, answers)]
    overlap = lambda a, b: any(min(e, f) > max(s, t) for s, e in a for t, f in b)  # noqa: E731
    assert any(overlap(ranges, q.truth) for ranges, q in zip(found, asked))
    for q, ranges in zip(asked, found):
        assert re.search(rf"{re.escape(q.query)} +answer {re.escape(f'{ranges[0][0]:.1f}')}-", result.stdout)
    manifest = json.loads((out / "onnx" / "onnx_manifest.json").read_text())
    assert manifest["model"]["input_type"] == "video" and manifest["model"]["num_contexts"] == 2

    held_out = out / "held-out"
    benchmark, predictions = held_out / "held-out.json", tmp_path / "torch.jsonl"
    retrieve(out / "converted", benchmark, held_out / "videos", predictions, "torch", max_new_tokens=ANSWER_TOKENS)
    answers = lambda path: {line["query_id"]: line["text"] for line in map(json.loads, path.open())}  # noqa: E731
    assert answers(held_out / "onnx.jsonl") == answers(predictions)
    trained, untrained = (score(held_out / f"{name}.jsonl", benchmark).overall for name in ("onnx", "untrained"))
    assert trained.queries == untrained.queries == len(json.loads(benchmark.read_text()))
    assert trained.iou >= 0.6 and untrained.iou < 0.05  # 0.646 for these weights (docs/benchmarks.md)
    assert f"IoU {trained.iou:.3f}" in result.stdout and f"IoU {untrained.iou:.3f}" in result.stdout


def drop_tensor(folder, name):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def truncate_first_shard(folder):
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])  # an interrupted copy: header intact, data cut short
    return shard.name


def huge_header_length(folder):
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[:8] = (10**12).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    return shard.name


BAD_INPUTS = {
    "missing tensor": (
        lambda d: drop_tensor(d, "model.layers.1.mlp.up_proj.weight"),
        "model.layers.1.mlp.up_proj.weight",
    ),
    "unknown model_type": (lambda d: edit_config(d, model_type="llava_next"), "model_type 'llava_next'"),
    "shape contradicts config": (lambda d: edit_config(d, intermediate_size=96), "mlp.gate_proj.weight has shape"),
    "bad attention mode": (lambda d: edit_config(d, dattn_mode="flash"), "dattn_mode"),
    "unknown vision tower": (lambda d: edit_config(d, mm_vision_tower="nowhere/tower"), "is neither a folder"),
    "missing config.json": (lambda d: (d / "config.json").unlink(), "has no config.json"),
    "config not JSON": (lambda d: (d / "config.json").write_text("{oops"), "config.json: not a readable config.json"),
    "index names a missing shard": (
        lambda d: sorted(d.glob("model-*.safetensors"))[1].unlink(),
        "missing shard model-00002-of-0000",
    ),
    "truncated shard": (truncate_first_shard, ".safetensors: tensor "),
    "header length beyond file": (huge_header_length, "header length 1000000000000 is larger than the file"),
}


# a process start each (torch and transformers imported): two in the fast tier, the others in the full run
FAST_BAD_INPUTS = ("missing tensor", "header length beyond file")


@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=() if case in FAST_BAD_INPUTS else pytest.mark.slow) for case in BAD_INPUTS]
)
def test_bad_checkpoint_gives_one_line_error(demo_checkpoint, tmp_path, case):
    folder = tmp_path / "ckpt"
    shutil.copytree(demo_checkpoint, folder)
    damage, expected = BAD_INPUTS[case]
    damage(folder)
    result = run_cli("generate", folder, "--prompt", "hi", "--max-new-tokens", "1")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert expected in lines[0] and str(folder) in lines[0], lines[0]


def test_shape_error_names_the_tensor_and_file(demo_checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(demo_checkpoint, folder)
    edit_config(folder, num_key_value_heads=4)
    result = run_cli("generate", folder, "--prompt", "hi")
    assert result.returncode == 2
    assert re.search(
        r"model-\d+-of-\d+\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape "
        r"\[64, 64\] but config\.json implies \[128, 64\]",
        result.stderr,
    ), result.stderr


def test_generate_with_image_matches_library(demo_checkpoint):
    result = run_cli(
        "generate",
        demo_checkpoint,
        "--prompt",
        "hello",
        "--image",
        demo_checkpoint / "demo.png",
        "--max-new-tokens",
        "5",
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"^  visual tokens +16$", result.stdout, re.M), result.stdout  # a log's summary: a line a value
    model = load_model(demo_checkpoint)
    torch.testing.assert_close(
        model.model.embed_tokens.weight,
        load_file(sorted(demo_checkpoint.glob("model-*.safetensors"))[0])["model.embed_tokens.weight"],
    )


def test_every_option_has_help_and_every_command_two_examples_that_parse(tmp_path, monkeypatch):
    """Each --help ends with two worked examples; each example parses with its command's own options."""
    import shlex

    from dattn_export import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "onnx").mkdir()
    (tmp_path / "videos").mkdir()  # retrieve's --videos
    named_files = ("cat.png", "clip.mp4", "questions.jsonl", "onnx/validation_report.json", "predictions.jsonl",
                   "VUE-TR_ground_truth.json", "int4.jsonl", "reference.jsonl", "bench.json")  # fmt: skip
    for existing in named_files:  # options naming a file
        (tmp_path / existing).touch()
    for name, command in cli.main.commands.items():
        options = [param for param in command.params if isinstance(param, click.Option)]
        assert all(option.help for option in options), [o.opts for o in options if not o.help]
        examples = [line.strip() for line in command.epilog.splitlines() if line.strip().startswith("dattn-export")]
        assert len(examples) == 2, name
        for example in examples:
            program, command_name, *args = shlex.split(example)
            assert command_name == name, example
            with command.make_context(name, args):  # a typo in an example raises a usage error here
                pass


@pytest.mark.parametrize("given", [["--asymmetric"], ["--block-size", "64", "--quantize-lm-head"]])
def test_quantization_options_without_quantize_are_refused(tmp_path, given):
    from click.testing import CliRunner

    from dattn_export import cli

    result = CliRunner().invoke(cli.main, ["onnx", str(tmp_path), "-o", str(tmp_path / "out"), *given])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "only with --quantize" in lines[0], result.stderr
    assert all(option in lines[0] for option in given if option.startswith("--"))
    assert not (tmp_path / "out").exists()
