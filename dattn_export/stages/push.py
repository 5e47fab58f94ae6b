"""`push`: a converted folder becomes a Hugging Face Hub model repo that transformers loads with
`trust_remote_code=True`, in one commit, with a model card.

The folder is verified first (manifest hashes, every tensor, the model loads). Everything goes up in a single
commit, so a failure publishes nothing half-way; large files go through LFS. Transient failures (5xx, 429,
dropped connections) are retried with backoff; the token is never printed, logged or uploaded.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..artifacts import ConvertManifest, sha256_file
from ..checkpoints.source import folder_config
from ..checkpoints.towers import tower_folder
from ..errors import InputError
from ..hub import retrying
from ..sidefiles import first_line, read_json
from .validate import ValidationReport
from .verify import Check, verify

TEXT_RULES = {
    "dattn": "alpha merge: one softmax over [visual ; text]",
    "dattn-sum": "sum of two softmaxes (visual, causal text)",
    "sattn": "conventional causal attention over [visual ; text]",
    "mmca": "multi-modal causal attention: sum of two softmaxes (visual, causal text)",
}


@dataclass
class UploadFile:
    path_in_repo: str
    size: int
    sha256: str
    local: Path | None = None
    content: bytes | None = None
    rewritten: bool = False  # the folder's file, published without this machine's paths


MEDIA_PARTS = {  # a message's medium, by the model's modality: the path the usage snippet reads
    "image": '{"type": "image", "path": "picture.jpg"},',
    "video": '{"type": "video", "path": "video.mp4"},  # 1 frame a second and its sound, as the released code reads it',
}


def usage_snippet(repo_id: str, question: str, modality: str = "image") -> str:
    """How the model card shows the model used: as any vision-language model on the Hub (AutoProcessor, a chat
    message with the picture's or video's path, generate, decode), asked `question`."""
    return f'''```python
from transformers import AutoModelForImageTextToText, AutoProcessor

repo = "{repo_id}"
processor = AutoProcessor.from_pretrained(repo, trust_remote_code=True)
model = AutoModelForImageTextToText.from_pretrained(repo, trust_remote_code=True, dtype="auto")

messages = [{{"role": "user", "content": [
    {MEDIA_PARTS[modality]}
    {{"type": "text", "text": {json.dumps(question)}}},
]}}]
inputs = processor.apply_chat_template(
    messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
)
tokens = model.generate(**inputs, max_new_tokens=64)
print(processor.decode(tokens[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```'''


REUSE_NOTE = (
    "Many questions about one {medium}: `context, segments = model.model.encode_inputs(**media)` (the inputs "
    "above but `input_ids` and `attention_mask`) computes its context once; `model.generate(input_ids=..., "
    "attention_mask=..., context_key_values=context, context_mask=segments)` asks each question with it."
)
# `generate` is transformers' own: every setting it takes works (the two most asked for, a line each)
GENERATION_NOTES = (
    "Sampling: `model.generate(**inputs, do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=64)`; beam "
    "search, stop strings and every logits processor as for any transformers model.",
    "Streaming: pass `streamer=TextIteratorStreamer(processor.tokenizer, skip_prompt=True)` to `generate` in a "
    "thread and read the text from the streamer as it comes.",
)


def model_card(
    folder: Path,
    repo_id: str,
    checks: list[Check] | None,
    license: str,
    base_model: str | None,
    validation: ValidationReport | None = None,
) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    from ..demo_model import DEMO_QUESTIONS

    config = folder_config(folder)
    manifest = ConvertManifest.read(folder)
    vision = config.vision_config
    family = config.family.name
    data = ModelCardData(
        license=license,
        library_name="transformers",
        pipeline_tag=f"{config.modality}-text-to-text",
        base_model=base_model,
        tags=["dattn", "custom_code", "vision-language", config.model_type, family]
        + (["compressed-tensors", manifest.quantization.scheme] if manifest.quantization else []),
    )
    params, local = manifest.model.parameters, local_paths(folder)
    tower = without_local_paths({"mm_vision_tower": config.mm_vision_tower}, local)["mm_vision_tower"]
    facts = [
        ("architecture", f"{family} decoder with D-Attn (decomposed attention), `dattn_mode={config.dattn_mode}`"),
        (
            "visual stream",
            "diagonal V2V (visual K/V depend on the image alone)"
            if config.use_diagonal
            else "full attention within each image"
            if config.v2v_per_image
            else "causal V2V",
        ),
        (
            "text attention",
            TEXT_RULES[config.dattn_mode]
            + (
                f"; WINGS visual and text learners (rank {config.wings_rank}) with a router in layers "
                f"{config.wings_layer_indices}"
                if config.wings_rank
                else ""
            ),
        ),
        (
            "layers / hidden / heads / KV heads",
            f"{config.num_hidden_layers} / {config.hidden_size} / {config.num_attention_heads} / "
            f"{config.num_key_value_heads}",
        ),
        (
            "vision tower",
            (f"{tower}: " if tower else "")
            + f"{vision['model_type']}, {vision['image_size']}px, patch {vision['patch_size']}, "
            f"{config.tokens_per_image} visual tokens per image",
        ),
        ("parameters", ", ".join(f"{k} {v:,}" for k, v in params.items()) + f" (total {sum(params.values()):,})"),
        (
            "weights",
            f"{manifest.dtype}, {sum(1 for f in manifest.files if f.endswith('.safetensors'))} safetensors shard(s)",
        ),
    ]
    if q := manifest.quantization:
        groups = f"groups of {q.group_size}" if q.group_size else "a scale per channel"
        facts.append((
            "quantization",
            f"{q.scheme} (compressed-tensors `{q.format}`, {groups}): the decoder layers' attention and MLP "
            f"projections; the towers, adapters, embeddings and head in {manifest.dtype}. vLLM serves it, "
            "transformers loads it; every quantized matrix verified within its rounding of the unquantized weights",
        ))  # fmt: skip
    lines = [
        f"# {repo_id.split('/')[-1]}",
        "",
        "A vision-language model with D-Attn (decomposed attention: Kuo et al., ICCV 2025), converted and "
        f"verified by dattn-export {__version__} from a `{manifest.source.layout}` checkpoint.",
        "",
        "| | |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in facts),
        "",
    ]
    if checks:
        lines += [
            "## Verification",
            "",
            "| check | result | detail |",
            "| --- | --- | --- |",
            *(
                f"| {c.name} | {'ok' if c.ok else 'FAILED'} | {without_local_paths(c.detail, local)} |" for c in checks
            ),  # a check may name the folder it compared with
            "",
        ]
    if validation is not None:
        v = validation
        lines += [
            "## ONNX validation",
            "",
            f"backend {v.backend}, {v.dtype}, greedy tokens {v.agreement}/{len(v.reference_tokens)} agree",
            "",
            "| graph | output | max abs error |",
            "| --- | --- | --- |",
            *(f"| {c.graph} | {c.output} | {c.max_abs:.2e} |" for c in v.comparisons),
            "",
        ]
    lines += [
        "## Usage",
        "",
        "The model and its processor ship in this repository (`modeling_dattn.py`, `processing_dattn.py`); "
        'nothing else is downloaded. `pipeline("image-text-to-text", model=repo, trust_remote_code=True)` '
        "answers the same messages.",
        "",
        usage_snippet(repo_id, DEMO_QUESTIONS[config.modality], config.modality),
        "",
        REUSE_NOTE.format(medium="video" if config.modality == "video" else "picture"),
        "",
        *(line for note in GENERATION_NOTES for line in (note, "")),
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


@dataclass
class LocalPaths:
    """This machine's paths a converted folder's files name, each with what is published instead."""

    paths: dict[str, str]  # absolute path -> its public name; the longest first, so a path goes before its parent
    towers: dict[str, str | None]  # a tower name as written (a folder) -> its Hub id, or None where none is known


def local_paths(folder: Path) -> LocalPaths:
    """The checkpoint the folder came from (published as its folder's name), the folder itself (and a quantized
    folder's 16-bit folder), and the tower folders (published as their Hub ids where one is known, else as their
    folders' names)."""
    manifest, config = ConvertManifest.read(folder), folder_config(folder)
    source = Path(manifest.source.path)
    paths = {str(source): source.name, str(folder.absolute()): folder.name, str(folder.resolve()): folder.name}
    if manifest.quantization is not None:  # the 16-bit folder it was quantized from
        paths[manifest.quantization.source] = Path(manifest.quantization.source).name
    towers = {}
    for name in (config.mm_vision_tower, config.mm_audio_tower):
        tower = tower_folder(name, source) or tower_folder(name, folder)
        if tower is None or is_hub_id(name):
            continue
        towers[name] = tower_hub_id(tower)
        public = towers[name] or tower.name
        paths |= {str(tower.absolute()): public, str(tower.resolve()): public}
        if Path(name).is_absolute():
            paths[name] = public
    paths = {path: public for path, public in paths.items() if Path(path).is_absolute() and len(Path(path).parts) > 1}
    return LocalPaths(dict(sorted(paths.items(), key=lambda item: -len(item[0]))), towers)


def is_hub_id(name: str | None) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or name.count("/") != 1 or Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def tower_hub_id(tower: Path) -> str | None:
    """The Hub id a tower folder was saved from: its config's `_name_or_path`, or its place in the Hub cache."""
    named = read_json(tower / "config.json", "tower config.json").get("_name_or_path")
    if isinstance(named, str) and is_hub_id(named):
        return named
    cached = next((part for part in tower.resolve().parts if part.startswith("models--")), None)
    return cached.removeprefix("models--").replace("--", "/", 1) if cached and cached.count("--") >= 2 else None


def without_local_paths(value, local: LocalPaths):
    """`value` (parsed JSON) with every local path in its strings replaced by its public name, and a tower key that
    names a local folder by the tower's Hub id, or null where none is known (the config carries the tower's config)."""
    if isinstance(value, dict):
        cleaned = {k: without_local_paths(v, local) for k, v in value.items()}
        for key in ("mm_vision_tower", "mm_audio_tower"):
            if isinstance(value.get(key), str) and value[key] in local.towers:
                cleaned[key] = local.towers[value[key]]
        return cleaned
    if isinstance(value, list):
        return [without_local_paths(v, local) for v in value]
    if isinstance(value, str):
        for path, public in local.paths.items():
            value = value.replace(path, public)
    return value


def plan_upload(folder: Path, card: str) -> list[UploadFile]:
    """Every file of the folder (hashes from the manifest where it has them) plus the model card. JSON files that
    name this machine's paths are published without them (the manifest then lists the published bytes); any other
    file that names one is refused rather than published."""
    folder = Path(folder)
    manifest, local = ConvertManifest.read(folder), local_paths(folder)
    published: dict[str, bytes] = {}
    for path in sorted(folder.glob("*.json")):
        fields = read_json(path, path.name)
        if (cleaned := without_local_paths(fields, local)) != fields:
            published[path.name] = (json.dumps(cleaned, indent=2) + "\n").encode()
    if published:  # the manifest lists each file's published bytes
        listed = json.loads(published.get(manifest.FILE) or (folder / manifest.FILE).read_bytes())
        for name, data in published.items():
            if name in listed["files"]:
                listed["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        published[manifest.FILE] = (json.dumps(listed, indent=2) + "\n").encode()
    files = []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        if path.name == "README.md":
            continue
        if path.name in published:
            data = published[path.name]
            digest = hashlib.sha256(data).hexdigest()
            files.append(UploadFile(path.name, len(data), digest, content=data, rewritten=True))
            continue
        refuse_local_paths(path, local)
        known = manifest.files.get(path.name)
        files.append(
            UploadFile(path.name, path.stat().st_size, known.sha256 if known else sha256_file(path), local=path)
        )
    data = card.encode()
    refuse_local_paths(Path("README.md"), local, data)
    files.append(UploadFile("README.md", len(data), hashlib.sha256(data).hexdigest(), content=data))
    return files


LOCAL_PATH_SCAN_BYTES = 64 << 20  # files larger than this are weights, whose bytes name no path


def refuse_local_paths(path: Path, local: LocalPaths, data: bytes | None = None) -> None:
    if data is None:
        if path.stat().st_size > LOCAL_PATH_SCAN_BYTES or path.suffix == ".safetensors":
            return
        data = path.read_bytes()
    named = next((p for p in local.paths if p.encode() in data), None)
    if named is not None:
        raise InputError(path, f"names a path of this machine ({named}): remove it, then push again")


def check_repo_id(repo_id: str) -> None:
    """namespace/name as the Hub takes it (huggingface_hub's own validator), checked before anything is contacted."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if repo_id.count("/") != 1:
        raise InputError("--repo-id", f"{repo_id!r} is not of the form namespace/name")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise InputError("--repo-id", f"{repo_id!r} is not a Hub repo id ({first_line(e)})") from None


@dataclass
class PushResult:
    repo_url: str
    commit_url: str | None
    pr_url: str | None
    files: list[UploadFile]
    card: str
    checks: list[Check] | None


def push(
    folder: Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    dry_run: bool = False,
    skip_verify: bool = False,
    license: str = "other",
    base_model: str | None = None,
    validation_report: Path | None = None,
) -> PushResult:
    """Verify `folder` and publish it in one commit; `validation_report` (an ONNX export's validation_report.json)
    adds its table to the model card."""
    check_repo_id(repo_id)
    folder = Path(folder)
    ConvertManifest.read(folder, "a folder written by dattn-export convert: push one")
    checks = None
    if not skip_verify:
        checks = verify(folder)
        failed = [c for c in checks if not c.ok]
        if failed:
            raise InputError(
                folder,
                f"does not verify ({failed[0].name}: {failed[0].detail}); refusing to publish "
                "(--skip-verify to override)",
            )
    validation = None if validation_report is None else ValidationReport.read(validation_report)
    card = model_card(folder, repo_id, checks, license, base_model, validation)
    files = plan_upload(folder, card)
    if dry_run:
        return PushResult(f"<hub>/{repo_id}", None, None, files, card, checks)

    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.utils import disable_progress_bars

    if not sys.stderr.isatty():  # the client's per-file upload bars help in a terminal, clutter a log
        disable_progress_bars()
    api = HfApi(token=token)
    location = f"{api.endpoint}/{repo_id}"
    repo_url = retrying("create repo", lambda: api.create_repo(repo_id, private=private, exist_ok=True), location)
    if revision not in (None, "main"):
        retrying(
            f"create branch {revision}", lambda: api.create_branch(repo_id, branch=revision, exist_ok=True), location
        )

    def commit():  # operations are single-use: rebuilt for every attempt
        operations = [CommitOperationAdd(f.path_in_repo, f.local if f.local is not None else f.content) for f in files]
        message = commit_message or f"Upload D-Attn model ({len(files)} files) with dattn-export {__version__}"
        return api.create_commit(repo_id, operations, commit_message=message, revision=revision, create_pr=create_pr)

    info = retrying("commit", commit, location)
    return PushResult(str(repo_url), info.commit_url, info.pr_url, files, card, checks)
