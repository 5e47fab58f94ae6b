"""A checkpoint as the rest of the toolkit sees it: its D-Attn config and its tensors under canonical names,
checked against the shapes the config implies, and the reference model built from it."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError

from .. import memory
from ..artifacts import DTYPES, carried_files, dtype_name
from ..errors import InputError
from ..modeling.configuration_dattn import CONFIG_CLASSES, FLOAT_DTYPES
from ..modeling.modeling_dattn import MODEL_CLASSES, DAttnForCausalLM
from ..processing import PROCESSOR_FILE, processor_folder
from ..sidefiles import first_line, read_json
from . import CheckpointReader, open_checkpoint
from .names import LAYER_STACKS, canonical_name, stored_layers
from .registry import Lazy
from .released import is_released, released_fields
from .towers import resolve_audio_config, resolve_vision_config, tower_folder
from .weights import empty_model, materialize, parameter_bytes, stream, streamed_bytes


def config_from_dict(fields: dict, source: Path):
    """A D-Attn config from config.json's fields; errors name the file and the key."""
    model_type = fields.get("model_type")
    if model_type not in CONFIG_CLASSES:
        raise InputError(
            source, f"model_type {model_type!r} is not a D-Attn model (expected one of {sorted(CONFIG_CLASSES)})"
        )
    fields = {k: v for k, v in fields.items() if k != "model_type"}
    if "torch_dtype" in fields:  # transformers 4.x's name for `dtype`
        fields.setdefault("dtype", fields.pop("torch_dtype"))
    dtype = fields.get("dtype")
    if dtype is not None and (not isinstance(dtype, str) or dtype.removeprefix("torch.") not in FLOAT_DTYPES):
        raise InputError(source, f"dtype {dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")
    try:
        config = CONFIG_CLASSES[model_type](**fields)
        config.vision_tower_config  # noqa: B018  (raises when vision_config is missing)
    except (StrictDataclassError, ValueError, TypeError, ZeroDivisionError) as e:
        # the validators' own words, without the dataclass machinery's preamble
        reason = re.sub(r"^Class validation error for validator '\w+': \w+: ", "", " ".join(str(e).split()))
        raise InputError(source, reason) from None
    return config


def folder_config(folder: Path):
    """The D-Attn config of a folder that holds its config.json as-is (converted or exported)."""
    return config_from_dict(read_json(Path(folder) / "config.json", "config.json"), Path(folder) / "config.json")


def tied_names(config) -> set[str]:
    """Names stored once because they share their tensor with another (lm_head tied to embed_tokens)."""
    return set(DAttnForCausalLM._tied_weights_keys) if config.tie_word_embeddings else set()


def expected_shapes(config, names, source: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor the config's model has, with its shape (built on the meta device: no memory). Each stack of
    layers is first checked against the layers the checkpoint's tensor `names` hold: a config that claims more is
    refused before its modules are built (a million claimed layers would take minutes and gigabytes to build)."""
    for what, configured, pattern in LAYER_STACKS:
        stored = stored_layers(names, pattern)
        if configured(config) > stored:
            raise InputError(source, f"config.json gives {configured(config)} {what}, the checkpoint holds {stored}")
    try:
        return model_shapes(config)
    except (RuntimeError, OverflowError) as e:  # sizes whose product overflows torch's own arithmetic
        raise InputError(source, f"implies tensors too large to exist ({first_line(e)})") from None


def model_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the config's model with its shape, the model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = MODEL_CLASSES[config.model_type](config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """`model_shapes` without the tensors tied to another (stored and counted once)."""
    tied = tied_names(config)
    return {name: shape for name, shape in model_shapes(config).items() if name not in tied}


@dataclass
class Source:
    """A checkpoint opened for reading: its config, its tensors by canonical name, and what is wrong."""

    reader: CheckpointReader
    config: object
    config_path: Path
    vision_origin: str
    audio_origin: str | None  # None: no audio tower
    tensors: dict[str, Lazy] = field(default_factory=dict)  # in the model's (state_dict) order
    stored_names: dict[str, str] = field(default_factory=dict)  # canonical -> as stored
    problems: list[InputError] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """The weights' bytes, as stored."""
        return sum(t.nbytes for t in self.tensors.values())

    def carried(self) -> list[Path]:
        """The tokenizer, processor and generation files an output carries (each JSON one parsed: a cut file is
        refused before any work); a released checkpoint's image processor lives in its vision tower's folder."""
        files = carried_files(self.reader.config_dir)
        if (found := processor_folder(self.reader.config_dir, self.config)) and found != self.reader.config_dir:
            files += carried_files(found, (PROCESSOR_FILE,))
        return files

    def carry_files(self, destination: Path) -> None:
        for path in self.carried():
            shutil.copyfile(path, Path(destination) / path.name)

    def inputs(self) -> list[Path]:
        """Every place this source is read from (checkpoints, the config's folder, tower folders): an output must
        stay apart from them."""
        towers = [
            tower_folder(name, self.reader.config_dir)
            for name in (self.config.mm_vision_tower, self.config.mm_audio_tower)
        ]
        return [*self.reader.paths, self.reader.config_dir, *(t for t in towers if t is not None)]

    def output_dtype(self, requested: str) -> torch.dtype:
        """A --dtype (artifacts.DTYPES' short names) as a torch dtype; auto: the dtype config.json declares (the
        training dtype), if none the dtype most weights have."""
        if requested != "auto":
            return DTYPES[requested].torch
        declared = self.config.dtype  # config.json's torch_dtype (4.x) or dtype (5.x)
        if isinstance(declared, str):
            declared = getattr(torch, declared, None)
        if isinstance(declared, torch.dtype) and declared.is_floating_point:
            return declared
        sizes: dict[torch.dtype, int] = {}
        for t in self.tensors.values():
            if t.dtype.is_floating_point:
                sizes[t.dtype] = sizes.get(t.dtype, 0) + t.nbytes
        return max(sizes, key=sizes.get)

    def raise_first_problem(self) -> None:
        if self.problems:
            first = self.problems[0]
            more = (
                f" (and {len(self.problems) - 1} more problem(s): see dattn-export info)"
                if len(self.problems) > 1
                else ""
            )
            raise InputError(first.path, first.problem + more)


def open_source(path: str | Path, base: str | Path | None = None, vision_heads: int | None = None) -> Source:
    """Open a checkpoint in any known layout and audit its tensors against its config (no data is read)."""
    return audit(open_checkpoint(path, base), vision_heads)


def audit(reader: CheckpointReader, vision_heads: int | None = None) -> Source:
    """The reader's config and its tensors checked against the shapes the config implies."""
    config_path = reader.config_dir / "config.json"
    if not config_path.is_file():
        raise InputError(reader.config_dir, "has no config.json")
    fields = read_json(config_path, "config.json")
    canonical = {canonical_name(n): (n, t) for n, t in reader.tensors.items()}
    shapes = {name: tuple(t.shape) for name, (_, t) in canonical.items()}
    vision_origin = audio_origin = None
    if is_released(fields):
        fields = released_fields(fields, config_path)
    if fields.get("model_type") in CONFIG_CLASSES:
        fields["vision_config"], vision_origin = resolve_vision_config(fields, shapes, vision_heads, config_path)
        fields["audio_config"], audio_origin = resolve_audio_config(fields, shapes, config_path)
        resolved = {"vision_config": vision_origin, "audio_config": audio_origin}
        inferred = {k: origin for k, origin in resolved.items() if origin and not origin.startswith("config.json")}
        if inferred:
            fields["dattn_inferred"] = {**(fields.get("dattn_inferred") or {}), **inferred}
    config = config_from_dict(fields, config_path)
    source = Source(reader, config, config_path, vision_origin or "-", audio_origin)
    expected = expected_shapes(config, canonical, config_path)
    for name, (stored, tensor) in canonical.items():
        if name not in expected:
            source.problems.append(
                InputError(tensor.file, f"unexpected tensor {stored} (not part of a {config.model_type} model)")
            )
        elif tuple(tensor.shape) != expected[name]:
            source.problems.append(
                InputError(
                    tensor.file,
                    f"tensor {stored} has shape {list(tensor.shape)} but config.json implies {list(expected[name])}",
                )
            )
        else:
            source.tensors[name], source.stored_names[name] = tensor, stored
    position = {name: k for k, name in enumerate(expected)}
    source.tensors = dict(sorted(source.tensors.items(), key=lambda item: position[item[0]]))  # the model's order
    missing = sorted(set(expected) - set(canonical) - tied_names(config))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        source.problems.append(InputError(reader.path, f"missing tensor {missing[0]}{more}"))
    return source


def build_model(source: Source, dtype: torch.dtype = torch.float32, whole: bool | None = None,
                device: str = "cpu") -> DAttnForCausalLM:  # fmt: skip
    """The reference model in `dtype`, without random initialisation (`weights.py`); refuses NaN/Inf weights and,
    for fp16, values fp16 cannot hold. `whole`: every weight in memory; otherwise (the default where the whole model
    does not fit in the memory available) its layers read their weights as they run, the same numbers. On a GPU
    (`device` "cuda") the whole model, each weight read, cast and moved there in turn."""
    source.raise_first_problem()
    model = empty_model(MODEL_CLASSES[source.config.model_type], source.config, dtype)
    whole_bytes = parameter_bytes(model)
    if device != "cpu":
        memory.require_gpu(whole_bytes, f"the model in {dtype_name(dtype)}")
        return materialize(model, source.tensors, source.stored_names, dtype, device=device).to(device)
    if whole if whole is not None else memory.fits(whole_bytes):
        return materialize(model, source.tensors, source.stored_names, dtype)
    memory.require(
        streamed_bytes(model),
        f"the reference model in {dtype_name(dtype)}, layer by layer (all of it: {memory.gib(whole_bytes)})",
        "free memory, or use a machine with more",
    )
    return stream(model, source.tensors, source.stored_names, dtype)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, **open_args) -> DAttnForCausalLM:
    """The reference model with a checkpoint's weights (any layout `convert` reads)."""
    return build_model(open_source(path, **open_args), dtype)


def saved_state_dict(model: DAttnForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors as a checkpoint stores them: canonical names, tied tensors once."""
    return {name: t for name, t in model.state_dict().items() if name not in tied_names(model.config)}
