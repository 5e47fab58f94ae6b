"""`dattn-export retrieve`: the released models' own job, temporal retrieval, over a benchmark of videos, on any
backend, written as VUE-TR's scorer reads predictions.

Queries are grouped by video: each video is decoded and its context encoded once, and every query about it answered
from that context (asked as the released scripts ask: the family's task prompt through the chat template, greedy).
The answer's fractions become seconds by the benchmark's `duration` where it gives one (the scorer's clock), else by
the file's (ffprobe's `format=duration`, which the released script's prompt states). A line a query is appended and
flushed as it is answered; a video that cannot be used (missing, undecodable, past the engine's length, out of
memory) is recorded on its queries with the reason, and the run goes on. The run's fingerprint (the model's manifest,
backend, dtype, prompt rule, new tokens) is in every line and beside the file (`PRED.run.json`), so that `--resume`
answers only what is left and refuses a file another run wrote; when the run ends the file is rewritten in the
benchmark's order, so that a run stopped and resumed ends as an uninterrupted one."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...artifacts import atomic_write, sha256_file
from ...errors import INPUT, InputError, from_os_error
from ...folders import CONVERT_MANIFEST, ONNX_MANIFEST, TRT_MANIFEST
from ...retrieval import ANSWERED, FAILED, UNPARSED, Query, read_benchmark
from ...ui import counted, progress, stages_unseen
from .videos import VIDEO_FAILURES, Answered, Video, failed, line_of, video_failure, videos_of

DEFAULT_MAX_NEW_TOKENS = 1024  # the released inference scripts' (many ranges fit)
RUN_SUFFIX = ".run.json"  # beside PRED: the run's fingerprint in full


@dataclass(frozen=True)
class Fingerprint:
    """What decides a run's answers: the model (its folder's manifest digest, or for training output its config's and
    its weight files' names and sizes), the backend and its dtype, the prompt rule (the family's task prompt and the
    chat template's digest) and the new tokens allowed."""

    model: str
    backend: str
    dtype: str
    prompt: str
    max_new_tokens: int

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def model_digest(folder: Path) -> str:
    """A folder's identity without reading its weights: its manifest's digest (which lists every file's), else its
    config.json's and its weight files' names and sizes."""
    folder = Path(folder)
    for name in (TRT_MANIFEST, ONNX_MANIFEST, CONVERT_MANIFEST):
        if (folder / name).is_file():
            return f"{name}:{sha256_file(folder / name)}"
    digest = hashlib.sha256()
    if (folder / "config.json").is_file():
        digest.update((folder / "config.json").read_bytes())
    weights = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt"))
    for path in weights:
        digest.update(f"{path.relative_to(folder)}:{path.stat().st_size}\n".encode())
    return f"config+weights:{digest.hexdigest()}"


def prompt_rule(config, tokenizer) -> str:
    template = hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16]
    return f"{config.family.name}: {config.family.released_task!r}; chat template {template}"


# --- the predictions file -------------------------------------------------------------------------------------


class PredictionsFile:
    """`PRED`, a JSONL line a query: opened fresh, or for `resume` with the lines already answered under the same
    fingerprint kept (a line cut by a kill, and failed queries, are answered again); each line appended, flushed and
    synced as it comes; `finish` rewrites it whole in the benchmark's order."""

    def __init__(self, path: Path, fingerprint: Fingerprint, resume: bool, force: bool):
        self.path, self.fingerprint, self.run = Path(path), fingerprint, fingerprint.digest
        self.done: dict = {}
        if self.path.exists() and not (resume or force):
            raise InputError(
                self.path, "already exists: pass --resume to answer what is left, or --force to start over"
            )
        if resume and self.path.exists():
            self.done = self.answered_before()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path.with_name(self.path.name + RUN_SUFFIX),
                         json.dumps({"run": self.run, **asdict(fingerprint)}, indent=2) + "\n")  # fmt: skip
            self.write_all(self.done.values())
            self.file = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            raise from_os_error(e, self.path) from None

    def answered_before(self) -> dict:
        """The lines of an earlier run with this fingerprint (failed queries left to answer again)."""
        text = self.path.read_text(encoding="utf-8", errors="replace")
        whole = text[: text.rfind("\n") + 1]  # a last line a kill cut short: its query is answered again
        lines = []
        for number, line in enumerate(whole.splitlines(), 1):
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                raise InputError(self.path, f"line {number} is not JSON: not a predictions file dattn-export "
                                 "retrieve wrote (pass --force to start over)") from None  # fmt: skip
        if other := next((line for line in lines if line.get("run") != self.run), None):
            raise InputError(self.path, f"was written by another run ({self.differences(other.get('run'))}): "
                             "--resume continues a run with the same model, backend, dtype, prompt and new tokens; "
                             "pass --force to start over")  # fmt: skip
        return {line["query_id"]: line for line in lines if line.get("status") != FAILED}

    def differences(self, run) -> str:
        """What differs from the run that wrote the file, by its fingerprint beside it."""
        beside = self.path.with_name(self.path.name + RUN_SUFFIX)
        try:
            before = json.loads(beside.read_text())
        except (OSError, ValueError):
            return f"run {run}, this one {self.run}"
        if before.get("run") != run:
            return f"run {run}, this one {self.run}"
        changed = [f"{name} {before.get(name)!r}, now {value!r}" for name, value in asdict(self.fingerprint).items()
                   if before.get(name) != value]  # fmt: skip
        return "; ".join(changed) or f"run {run}"

    def append(self, line: dict) -> None:
        self.file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.done[line["query_id"]] = line

    def write_all(self, lines) -> None:
        atomic_write(self.path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))

    def finish(self, order: list[Query], as_list: Path | None) -> None:
        """The file rewritten in the benchmark's order; with `as_list`, the same lines as a JSON list there too."""
        lines = [self.done[query.query_id] for query in order if query.query_id in self.done]
        self.write_all(lines)
        if as_list is not None:
            atomic_write(as_list, json.dumps(lines, indent=1, ensure_ascii=False) + "\n")


class LocalAnswers:
    """The answering of torch, ort, trt and genai (`generate.Asker`: the model loaded once, in this process): each
    video decoded and encoded once, its queries answered from it in turn."""

    def __init__(self, asker, max_new_tokens: int):
        self.asker, self.max_new_tokens = asker, max_new_tokens
        self.where = f"this process ({asker.backend}, {asker.device})"

    def __call__(self, videos: list[Video], seconds: dict[str, float]) -> Iterator[Answered]:
        for video in videos:
            yield from self.video(video, seconds)

    def video(self, video: Video, seconds: dict[str, float]) -> Iterator[Answered]:
        from ...media_options import Media
        from ...prompts import Prompt

        prompts, done = [Prompt(query.query, "query") for query in video.queries], 0
        try:
            decoded = self.asker.decode(Media(video=video.path), prompts)
            texts = self.asker.texts(prompts, True, decoded)
            for query, result in zip(video.queries, self.asker.ask(texts, decoded, self.max_new_tokens, seconds)):
                yield Answered(query, result.text, decoded.duration)
                done += 1
        except VIDEO_FAILURES as e:  # the queries not answered yet
            reason, code = video_failure(e)
            yield from failed(Video(video.name, video.queries[done:]), reason, code)


@dataclass
class Summary:
    """What a run did, for its closing table."""

    out: Path
    backend: str
    videos: int
    queries: int
    answered: int = 0
    unparsed: int = 0
    failed: int = 0
    skipped: int = 0  # answered by an earlier run (--resume)
    where: str = ""  # what answered: this process, an engine, replicas on a cluster
    seconds: float = 0.0
    failures: list[tuple[str, str, int]] = field(default_factory=list)  # (video, reason, exit code), a line a video

    @property
    def queries_per_second(self) -> float:
        done = self.answered + self.unparsed + self.failed
        return done / self.seconds if self.seconds else 0.0

    def count(self, line: dict) -> None:
        status = line["status"]
        self.answered += status == ANSWERED
        self.unparsed += status == UNPARSED
        self.failed += status == FAILED


def retrieve(
    model: Path,
    benchmark: Path,
    videos_folder: Path,
    out: Path,
    backend: str = "torch",
    device: str = "cpu",
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    resume: bool = False,
    force: bool = False,
    json_list: Path | None = None,
    tensor_parallel: int = 1,
    ray_address: str | None = None,
    replicas: int = 1,
    verbose: bool = False,
    show=progress,
) -> Summary:
    """Answer every query of `benchmark` about its video in `videos_folder` with `backend` on `model`, into `out`."""
    queries = read_benchmark(benchmark)
    videos = videos_of(queries, videos_folder)
    if backend == "vllm":
        from ...checkpoints.source import folder_config
        from ...processing import load_tokenizer
        from .engine import check_servable, engine_dtype

        config = folder_config(model)
        check_servable(model, config)
        tokenizer, dtype = load_tokenizer(model, config), engine_dtype(config)
    else:
        from ..generate import Asker

        asker = Asker(model, backend, device)
        config, tokenizer, dtype = asker.config, asker.tokenizer, local_dtype(asker)
    if config.modality != "video" or config.family.released_task is None:
        raise InputError(Path(model) / "config.json", "is not a video model of a released family: retrieval asks "
                         "the released task of a video model (Vidi-7B's or Vidi1.5-9B's family)")  # fmt: skip
    fingerprint = Fingerprint(model_digest(model), backend, dtype, prompt_rule(config, tokenizer), max_new_tokens)
    predictions = PredictionsFile(out, fingerprint, resume, force)
    summary = Summary(Path(out), backend, len(videos), len(queries), skipped=len(predictions.done))
    todo = [Video(v.name, [q for q in v.queries if q.query_id not in predictions.done], v.path, v.missing)
            for v in videos]  # fmt: skip
    todo = [video for video in todo if video.queries]
    decodable = [video for video in todo if video.path is not None]
    start, seconds, asked = time.perf_counter(), {}, len(queries) - summary.skipped
    try:
        if backend != "vllm":
            answer_all = LocalAnswers(asker, max_new_tokens)
        elif decodable:  # engines sized for the videos: one on this machine, or replicas on a Ray cluster
            from .engine import Engine, sizes

            frames, prompt_tokens = sizes(model, decodable)
            if ray_address is None:
                answer_all = Engine(model, frames, prompt_tokens, max_new_tokens, tensor_parallel, verbose)
            else:
                from .replicas import RayReplicas

                answer_all = RayReplicas(model, frames, prompt_tokens, max_new_tokens, tensor_parallel, ray_address,
                                         replicas, verbose)  # fmt: skip
        summary.where = answer_all.where if decodable else "nothing to decode"
        with show(f"answering {asked} {'query' if asked == 1 else 'queries'}", asked, "queries") as advance, \
                stages_unseen():  # fmt: skip
            left = {video.name: len(video.queries) for video in todo}
            for video in [v for v in todo if v.path is None]:  # nothing to decode: recorded at once
                for answered in failed(video, video.missing, INPUT):
                    record(predictions, summary, answered, config, advance, left, len(todo))
            for answered in answer_all(decodable, seconds) if decodable else ():
                record(predictions, summary, answered, config, advance, left, len(todo))
    finally:
        predictions.file.close()  # every line answered so far stays, for --resume
    summary.seconds = time.perf_counter() - start
    predictions.finish(queries, json_list)
    return summary


def record(predictions: PredictionsFile, summary: Summary, answered: Answered, config, advance: Callable,
           left: dict[str, int], videos: int) -> None:  # fmt: skip
    """One answer into the file, the summary and the progress (with the videos done)."""
    line = line_of(answered, config.family, predictions.run)
    predictions.append(line)
    summary.count(line)
    left[answered.query.video] -= 1
    if answered.failure and not any(video == answered.query.video for video, _, _ in summary.failures):
        summary.failures.append((answered.query.video, answered.failure, answered.code))
    done = sum(1 for count in left.values() if count == 0)
    advance(1, f"{done} of {counted(videos, 'video')} done")


def local_dtype(asker) -> str:
    """The dtype a local backend computes in: the reference's (fp32 on a CPU), the graphs' own."""
    if asker.backend == "torch":
        from ..generate import gpu_dtype

        return "float32" if asker.device == "cpu" else str(gpu_dtype(asker.source)).removeprefix("torch.")
    from ...artifacts import DTYPES, OnnxManifest, TrtManifest

    manifest = (TrtManifest if asker.backend == "trt" else OnnxManifest).read(asker.folder, "exported graphs")
    graph = next(i.dtype for i in manifest.graphs["decoder"].inputs if i.name.startswith("past_key_values."))
    return next(d.name for d in DTYPES.values() if d.onnx == graph)
