"""`verify`: a converted folder is what its manifest says, reloads exactly, and the model runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .. import memory
from ..artifacts import ConvertManifest, dtype_name, named_dtype, sha256_file
from ..checkpoints.plan import checked_cast
from ..checkpoints.source import build_model, folder_config, open_source
from ..errors import InputError
from ..modeling.modeling_dattn import MODEL_CLASSES
from ..ui import quiet


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def check_files(out: Path, manifest: ConvertManifest, progress=quiet) -> Check:
    bad = []
    with progress("hashing files", sum(f.size for f in manifest.files.values())) as advance:
        for name, expected in manifest.files.items():
            path = out / name
            if not path.is_file():
                bad.append(f"{name} missing")
            elif path.stat().st_size != expected.size:
                bad.append(f"{name} has {path.stat().st_size} bytes, manifest says {expected.size}")
            elif sha256_file(path) != expected.sha256:
                bad.append(f"{name} sha256 differs from the manifest")
            advance(expected.size, name)
    unlisted = [p.name for p in out.glob("*.safetensors") if p.name not in manifest.files]
    bad += [f"{name} is not in the manifest" for name in unlisted]
    return Check("files: size and sha256", not bad, "; ".join(bad) or f"{len(manifest.files)} files match")


def check_tensors(out: Path, manifest: ConvertManifest, against, progress=quiet, skip=frozenset()) -> Check:
    """Every tensor reloads (safetensors' own reader) with the manifest's dtype and shape; with a source,
    it equals the source tensor after the requested cast, bit for bit. `skip`: matrices checked otherwise (their
    quantized tensors)."""
    bad, seen = [], set()
    shards = sorted({t.file for t in manifest.tensors.values()})
    what = "comparing tensors with the source" if against is not None else "reloading tensors"
    sizes = {shard: (out / shard).stat().st_size for shard in shards if (out / shard).is_file()}
    with progress(what, sum(sizes.values())) as advance:
        for shard in shards:
            try:
                handle = safe_open(out / shard, framework="pt")
            except (SafetensorError, OSError) as e:
                return Check("tensors reload", False, f"{shard}: {e}")
            read = 0
            for name in handle.keys():
                if name.rsplit(".", 1)[0] + ".weight" in skip:
                    continue
                seen.add(name)
                tensor, expected = handle.get_tensor(name), manifest.tensors.get(name)
                advance(tensor.nbytes, name)
                read += tensor.nbytes
                if expected is None:
                    bad.append(f"{name} not in the manifest")
                elif dtype_name(tensor.dtype) != expected.dtype or list(tensor.shape) != expected.shape:
                    bad.append(
                        f"{name} is {tensor.dtype} {list(tensor.shape)}, manifest says {expected.dtype} "
                        f"{expected.shape}"
                    )
                elif against is not None:
                    source = checked_cast(name, against.tensors[name], tensor.dtype)
                    if not torch.equal(source.view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)):
                        bad.append(f"{name} differs from the source after the cast")
            advance(sizes[shard] - read)  # the shard's header
    bad += [f"{name} missing from the shards" for name in sorted(set(manifest.tensors) - seen)]
    what = (
        "bit-exact against the source after the cast"
        if against is not None
        else "each of the dtype and shape convert recorded (against no source: `verify --against SOURCE` compares)"
    )
    return Check("tensors reload", not bad, "; ".join(bad[:3]) or f"{len(seen)} tensors, {what}")


def probe_logits(model, seed: int = 0) -> torch.Tensor:
    """Logits of an 8-token random prompt with a random image (a video model: two frames and one audio chunk)."""
    config, generator = model.config, torch.Generator().manual_seed(seed)
    ids = torch.randint(3, config.vocab_size, (1, 8), generator=generator)
    return PROBES[config.modality](model, ids, generator)


def image_probe(model, ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    size = model.config.vision_config["image_size"]
    return model(ids, torch.randn(1, 1, 3, size, size, generator=generator)).logits


def video_probe(model, ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    config = model.config
    size = config.vision_config["image_size"]
    chunk = 2 * config.audio_config["max_source_positions"]  # mel frames a Whisper encoder takes
    frames = model.model.encode_video([torch.randn(2, 3, size, size, generator=generator)])
    mel = torch.randn(1, config.audio_config["num_mel_bins"], chunk, generator=generator)
    context, segments = model.model.join_contexts(frames, model.model.encode_audio([mel], [chunk]))
    return model(ids, context_key_values=context, context_mask=segments).logits


PROBES = {"image": image_probe, "video": video_probe}  # by what the model takes


def check_model(out: Path, manifest: ConvertManifest, progress=quiet) -> Check:
    """The folder loads as the reference model and gives finite logits. (Against a source, the tensors' check has
    already found every tensor bit-exact after the cast: the source's model computes the same numbers, so it is
    not run again.) A quantized folder loads as transformers loads it (compressed-tensors' decompression)."""
    if manifest.quantization is not None:  # transformers decompresses every matrix into the folder's dtype
        needed = sum(manifest.model.parameters.values()) * named_dtype(manifest.dtype).itemsize
        if not memory.fits(needed + needed // 2):
            return Check("model loads and runs", True, f"not run here: transformers decompresses it to about "
                         f"{memory.gib(needed)} of {manifest.dtype} weights, and {memory.gib(memory.available())} "
                         "is available (the tensors' check holds every matrix)")  # fmt: skip
    with torch.no_grad(), progress("loading the model and running a prompt", 1, "model") as advance:
        if manifest.quantization is not None:
            model_class = MODEL_CLASSES[folder_config(out).model_type]
            model = model_class.from_pretrained(out, dtype=named_dtype(manifest.dtype))
        else:
            model = build_model(open_source(out))
        logits = probe_logits(model)
        advance(1)
    if not torch.isfinite(logits).all():
        return Check("model loads and runs", False, "non-finite logits")
    return Check("model loads and runs", True, f"logits {list(logits.shape)} finite")


def check_chat_template(out: Path, source=None) -> Check:
    """The folder asks as its source was trained to be asked: its chat template renders a question about a picture
    (the media's marker in its turn), and is its source's where the source has a tokenizer."""
    from ..modeling.marked_prompts import MEDIA_MARKERS
    from ..processing import TOKENIZER_FILES, load_tokenizer
    from ..prompts import chat_text

    name = "chat template"
    if not any((out / file).is_file() for file in TOKENIZER_FILES):  # training output that carried none
        return Check(name, True, "no tokenizer, so no chat template: add the model's to ask it questions")
    tokenizer = load_tokenizer(out, folder_config(out))
    template = tokenizer.chat_template
    if not template:
        return Check(name, True, "no chat template: ask with --raw-prompt (or add the model's as chat_template.jinja)")
    try:
        asked = chat_text(tokenizer, f"{MEDIA_MARKERS[0]}\nWhat is in the picture?")
    except Exception as e:  # noqa: BLE001  (a template that does not render is this check's finding)
        return Check(name, False, f"chat template does not render a question: {type(e).__name__}")
    if MEDIA_MARKERS[0] not in asked:
        return Check(name, False, "chat template drops the media's marker from a question")
    folder = None if source is None else source.reader.config_dir  # where its tokenizer files are, if anywhere
    if folder is not None and any((folder / name).is_file() for name in TOKENIZER_FILES):
        if load_tokenizer(folder, source.config).chat_template != template:
            return Check(name, False, "chat template differs from the source's")
        return Check(name, True, "chat template the source's, asking with the media first")
    return Check(name, True, "chat template asks with the media first")


def check_quantized(out: Path, manifest: ConvertManifest, source, progress=quiet) -> Check:
    """A folder `quantize` wrote: its kept tensors bit-exact against the unquantized folder, every quantized matrix
    within its scheme's rounding of its source (`weight_check.check_compressed`), naming the first that is not."""
    from .weight_check import check_compressed

    quantized = set(manifest.quantization.matrices)
    kept = {name: entry for name, entry in manifest.tensors.items() if entry.source_name not in quantized}
    exact = check_tensors(out, dataclasses.replace(manifest, tensors=kept), source, progress, skip=quantized)
    report = check_compressed(out, manifest, source, progress)
    worst = report.worst
    if not exact.ok or not report.passed:
        return Check("tensors reload", False, "; ".join(filter(None, [None if exact.ok else exact.detail,
                                                                     report.first_failure()])))  # fmt: skip
    return Check(
        "tensors reload",
        True,
        f"{len(kept)} tensors bit-exact against {manifest.quantization.source}; {len(report.matrices)} "
        f"{manifest.quantization.scheme} matrices within their rounding of it (worst {worst.worst_ratio:.5f} of "
        f"the bound, {worst.node})",
    )


def quantized_from(out: Path, manifest: ConvertManifest, against: Path | None) -> Path | None:
    """What a folder is checked against: `against` if given, else a quantized folder's 16-bit folder (the one its
    manifest names, which must still be there), else nothing."""
    if manifest.quantization is None or against is not None:
        return against
    sixteen = Path(manifest.quantization.source)
    if not (sixteen / "config.json").is_file():
        raise InputError(out, f"was quantized from {sixteen}, which is gone: pass the unquantized folder as --against")
    return sixteen


def verify(
    out: Path, against: Path | None = None, base: Path | None = None, vision_heads: int | None = None, progress=quiet
) -> list[Check]:
    """`progress`: `ui.progress` to show each check's progress (the CLI's), or `ui.quiet`. A quantized folder is
    checked against its 16-bit folder (`against`, else the one its manifest names)."""
    out = Path(out)
    manifest = ConvertManifest.read(out, "a folder written by dattn-export convert")
    against = quantized_from(out, manifest, against)
    source = None
    if against is not None:
        source = open_source(against, base, vision_heads)
        source.raise_first_problem()
    tensors = (
        check_tensors(out, manifest, source, progress)
        if manifest.quantization is None
        else check_quantized(out, manifest, source, progress)
    )
    return [
        check_files(out, manifest, progress),
        tensors,
        check_model(out, manifest, progress),
        check_chat_template(out, source),
    ]
