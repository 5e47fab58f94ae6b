"""`validate --benchmark`: the task gate, on the demo's trained video model and two clips of the synthetic benchmark's
held-out split. The fp32 export answers as the PyTorch reference does, query for query; a healthy int4 export passes
its row, and a w4a16 folder served by vLLM its; an int4 export with two layers exchanged (what no real tool writes)
fails the gate where its weights go unchecked; the reference's and the export's scores against the truth are
`score`'s of `retrieve`'s predictions."""

import json
import os

import pytest
from helpers.cli import error_line, run_cli
from helpers.quantized import broken_export
from test_vllm import vllm_missing

from dattn_export.artifacts import Scheme
from dattn_export.demo_corpus import write_benchmark
from dattn_export.demo_retrieval import ANSWER_TOKENS, trained_weights, write_retrieval_checkpoint
from dattn_export.stages.accuracy_gate import GATES
from dattn_export.stages.convert import convert
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.stages.quantize import quantize
from dattn_export.stages.retrieve.job import retrieve
from dattn_export.stages.score import score
from dattn_export.stages.task_gate import TASK_GATES


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory):
    return write_benchmark(tmp_path_factory.mktemp("bench"), "held-out", 2)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Mistral's trained model converted, exported in fp32 and with int4 weights."""
    root = tmp_path_factory.mktemp("task_gate")
    checkpoint = write_retrieval_checkpoint(root / "checkpoint", "mistral", trained_weights("mistral"))
    converted = convert(checkpoint, root / "converted").out
    export_onnx(converted, root / "onnx")
    export_onnx(converted, root / "int4", quantize=Scheme("int4"))
    return root


def gated(folder, benchmark, *options, env=None):
    run = run_cli("validate", folder, "--video", benchmark.parent / "videos" / "clip1000000.mov", "--benchmark",
                  benchmark, "--videos", benchmark.parent / "videos", "--answer-tokens", ANSWER_TOKENS, *options,
                  env=env, timeout=600)  # fmt: skip
    return run, json.loads((folder / "validation_report.json").read_text())


@pytest.mark.slow
def test_the_fp32_export_gives_the_reference_s_answers_and_scores(exports, benchmark, tmp_path):
    root = exports
    run, report = gated(root / "onnx", benchmark)
    assert run.returncode == 0 and "the task gate passed" in run.stdout, run.stdout + run.stderr[-2000:]
    task = report["task"]
    assert task["weights"] == "exact" and task["threshold"] == TASK_GATES["exact"] and task["passed"]
    assert task["identical"] == task["queries"] == 15 and task["differences"] == []
    # every IoU 1: the share above t is 1 up to t = 0.99 and 0 at t = 1 (VUE-TR counts strictly above)
    assert task["agreement"] == pytest.approx(1 - 0.01 / 2)
    retrieve(root / "converted", benchmark, benchmark.parent / "videos", tmp_path / "torch.jsonl",
             max_new_tokens=ANSWER_TOKENS)  # fmt: skip
    truth = score(tmp_path / "torch.jsonl", benchmark).overall.iou
    assert task["reference_iou"] == task["deployment_iou"] == truth > 0.2  # the trained model finds seconds


@pytest.mark.slow
def test_int4_passes_its_row_and_two_layers_exchanged_fail_the_gate(exports, benchmark, tmp_path):
    root = exports
    run, report = gated(root / "int4", benchmark)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert report["task"]["weights"] == "int4" and report["task"]["agreement"] >= TASK_GATES["int4"]
    broken = broken_export(root / "int4", tmp_path / "swapped", "swap")
    run, report = gated(broken, benchmark, "--no-weight-check")
    assert run.returncode == 1 and "the task gate FAILED" in run.stdout, run.stdout + run.stderr[-2000:]
    task = report["task"]
    assert not task["passed"] and task["agreement"] < TASK_GATES["int4"] and task["differences"]
    assert f"query {task['differences'][0]['query_id']}: reference" in run.stdout


@pytest.mark.slow
@vllm_missing
def test_a_w4a16_folder_on_vllm_passes_its_row(benchmark, tmp_path):
    """Gemma 2's trained model quantized to w4a16, served by vLLM (bf16 on a CPU) against the fp32 reference: the
    weight check, the accuracy gate and the task gate, each its row."""
    checkpoint = write_retrieval_checkpoint(tmp_path / "checkpoint", "gemma2", trained_weights("gemma2"))
    folder = quantize(convert(checkpoint, tmp_path / "converted").out, tmp_path / "w4a16", "w4a16", 32).out
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    run, report = gated(folder, benchmark, "--backend", "vllm", env=env)
    assert run.returncode == 0 and "the task gate passed" in run.stdout, run.stdout + run.stderr[-3000:]
    gate, row = report["gate"], GATES["w4a16"]
    assert report["weights"]["passed"] and len(report["weights"]["matrices"]) == 7 * 3  # q k v o gate up down
    assert gate["passed"] and gate["scheme"] == "w4a16" and gate["positions"] == 4 * 20  # 4 prompts, 20 tokens
    assert gate["thresholds"] == {"greedy_mass": row.greedy_mass, "top5_mass": row.top5_mass, "mean_kl": row.mean_kl}
    task = report["task"]
    assert task["weights"] == "w4a16" and task["agreement"] >= TASK_GATES["w4a16"] and task["queries"] == 15


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--benchmark", "B"], "--benchmark and --videos go together"),
        (["--benchmark", "B", "--videos", "V", "--backend", "torch"], "not with --backend torch or --weights-only"),
    ],
)
def test_the_task_gate_s_options_are_refused_in_one_line(tmp_path, options, message):
    (tmp_path / "B").write_text("[]")
    (tmp_path / "V").mkdir()
    run = run_cli("validate", tmp_path, *[tmp_path / o if o in "BV" else o for o in options])
    assert run.returncode == 2 and message in error_line(run.stderr), run.stderr
