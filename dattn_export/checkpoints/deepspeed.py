"""DeepSpeed ZeRO-1/2/3 `global_stepN/` folders and Trainer `checkpoint-N/` folders, without DeepSpeed.

The fp32 master weights are rebuilt exactly as DeepSpeed's `zero_to_fp32` does, but lazily: each tensor is
a list of byte ranges in the rank files, read only when it is written out.

ZeRO-1/2: per param group, each rank holds an equal slice of the group's flat buffer
  (`single_partition_of_fp32_groups`); the buffer is the parameters concatenated in `param_shapes` order,
  padded at the end (alignment 2 x world size).
ZeRO-3: each rank holds ceil(numel / world_size) elements of every parameter, padding at the end of each
  parameter (`fp32_flat_groups`, groups concatenated per rank).
Frozen parameters live in the model-states files (`frozen_param_fragments`), except under ZeRO-1, which
records none: there they exist only in `module` (16-bit). Shared ones are `shared_params` aliases, buffers
are in `module`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from ..errors import InputError
from ..folders import LAYOUTS, ZERO_MODEL_STATES, ZERO_OPTIM_STATES, ZERO_STEPS
from .hf import SafetensorsReader, TorchBinReader
from .lazy import GatheredTensor, LazyTensor, read_torch_file, slice_flat
from .registry import CheckpointReader, register


def natural_key(path: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def rank_of(path: Path) -> int:
    match = re.search(r"zero_pp_rank_(\d+)_", path.name)
    return int(match.group(1)) if match else 0


def _dict(value, file: Path, key: str) -> dict:
    if not isinstance(value, dict):
        raise InputError(file, f"has no '{key}' dictionary: not a DeepSpeed ZeRO checkpoint file")
    return value


def _as_int(value) -> int:
    return max(_as_int(v) for v in value) if isinstance(value, list) else int(value)


@register
class ZeroReader(CheckpointReader):
    layout = "deepspeed-zero"

    def __init__(self, path: Path):
        super().__init__(path)
        if (path.parent / "config.json").is_file():
            self.config_dir = path.parent  # global_stepN/ inside a Trainer checkpoint-N/ folder
        model_files = sorted(path.glob(ZERO_MODEL_STATES), key=natural_key)
        optim_files = sorted(path.glob(ZERO_OPTIM_STATES), key=natural_key)
        if not model_files:
            raise InputError(path, f"has optimizer states but no {ZERO_MODEL_STATES}: the parameter shapes are missing")
        if not optim_files:
            raise InputError(path, f"has model states but no {ZERO_OPTIM_STATES} files: the fp32 weights are missing")
        model_states = [_dict(read_torch_file(f), f, "module") for f in model_files]
        optim_states = [
            _dict(read_torch_file(f).get("optimizer_state_dict"), f, "optimizer_state_dict") for f in optim_files
        ]
        first = optim_states[0]
        if "zero_stage" not in first:
            raise InputError(optim_files[0], "has no zero_stage: not a ZeRO optimizer checkpoint")
        stage, world_size = _as_int(first["zero_stage"]), _as_int(first.get("partition_count", 1))
        ranks = sorted(rank_of(f) for f in optim_files)
        if ranks != list(range(world_size)):
            missing = sorted(set(range(world_size)) - set(ranks))
            problem = f"rank file(s) {missing} missing" if missing else f"found ranks {ranks}"
            raise InputError(path, f"ZeRO-{stage} checkpoint of world size {world_size} (partition_count): {problem}")
        if stage == 3 and len(model_files) != world_size:
            raise InputError(
                path, f"ZeRO-3 needs {world_size} {ZERO_MODEL_STATES} files (one per rank), found {len(model_files)}"
            )
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        flat_groups = []
        for file, state in zip(optim_files, optim_states):
            groups = state.get(key)
            if not isinstance(groups, list) or not all(isinstance(g, LazyTensor) and len(g.shape) == 1 for g in groups):
                raise InputError(file, f"has no '{key}' list of flat fp32 tensors (ZeRO-{stage})")
            flat_groups.append(groups)
        shapes_source = model_states[0].get("param_shapes")
        if not shapes_source:
            raise InputError(model_files[0], "has no param_shapes: cannot cut the flat fp32 groups into tensors")
        param_groups = [
            checked_shapes(group, model_files[0], "param_shapes")
            for group in (shapes_source if isinstance(shapes_source, list) else [shapes_source])
        ]
        rebuild = self._zero3 if stage == 3 else self._zero2
        try:
            self._buffers(model_states[0])
            self._frozen(model_states, stage, world_size)
            rebuild([dict(g) for g in param_groups], flat_groups, world_size)
        except ValueError as e:
            raise InputError(path, f"ZeRO-{stage} world size {world_size}: {e}") from None
        for alias, source in dict(model_states[0].get("shared_params") or {}).items():
            if source in self.tensors:
                self.tensors[alias] = self.tensors[source]
        self.notes.append(f"ZeRO-{stage}, world size {world_size}, fp32 master weights ({len(optim_files)} rank files)")
        self._unrecorded_frozen(model_states[0], model_files[0].name)

    def _unrecorded_frozen(self, state: dict, file_name: str) -> None:
        """ZeRO-1 records no frozen_param_shapes: a frozen parameter exists only as the module's 16-bit copy (and
        DeepSpeed's zero_to_fp32 drops it). Take it from there, so the model is complete, and say so."""
        module = state.get("module") or {}
        restored = [
            name
            for name, tensor in module.items()
            if name not in self.tensors and isinstance(tensor, LazyTensor) and tensor.numel
        ]
        for name in restored:
            self.tensors[name] = module[name]
        if restored:
            dtypes = sorted({str(module[n].dtype).removeprefix("torch.") for n in restored})
            self.notes.append(
                f"{len(restored)} frozen tensor(s) restored from {file_name}'s module ({', '.join(dtypes)}): "
                "DeepSpeed keeps no fp32 copy of them and its zero_to_fp32 drops them"
            )

    def _buffers(self, state: dict) -> None:
        module = state.get("module") or {}
        for name in state.get("buffer_names") or []:
            if isinstance(module.get(name), LazyTensor):
                self.tensors[name] = module[name]

    def _frozen(self, model_states: list[dict], stage: int, world_size: int) -> None:
        shapes = checked_shapes(model_states[0].get("frozen_param_shapes") or {}, self.path, "frozen_param_shapes")
        for name, shape in shapes.items():
            fragments = [(state.get("frozen_param_fragments") or {}).get(name) for state in model_states]
            if not all(isinstance(f, LazyTensor) for f in fragments):
                raise ValueError(f"frozen parameter {name} has no fragment in every model-states file")
            if stage < 3:
                self.tensors[name] = GatheredTensor((_flat(fragments[0]),), tuple(shape))
            else:
                self.tensors[name] = GatheredTensor(tuple(_flat(f) for f in fragments), tuple(shape))

    def _zero2(self, param_groups: list[dict], flat_groups: list[list[LazyTensor]], world_size: int) -> None:
        if any(len(groups) != len(param_groups) for groups in flat_groups):
            raise ValueError(
                f"{len(param_groups)} param groups in param_shapes, but rank files hold {[len(g) for g in flat_groups]}"
            )
        align = 2 * world_size
        for g, shapes in enumerate(param_groups):
            rank_slices = [groups[g] for groups in flat_groups]  # the group's flat buffer, rank by rank
            available, offset = sum(p.numel for p in rank_slices), 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                self.tensors[name] = GatheredTensor(tuple(slice_flat(rank_slices, offset, numel)), tuple(shape))
                offset += numel
            if align * math.ceil(offset / align) != align * math.ceil(available / align):
                raise ValueError(f"param group {g}: parameters take {offset} elements, the ranks hold {available}")

    def _zero3(self, param_groups: list[dict], flat_groups: list[list[LazyTensor]], world_size: int) -> None:
        shapes = {name: shape for group in param_groups for name, shape in group.items()}
        per_rank = [sum(p.numel for p in groups) for groups in flat_groups]
        if len(set(per_rank)) != 1:
            raise ValueError(f"ranks hold different numbers of elements {per_rank}")
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world_size)
            pieces = tuple(p for groups in flat_groups for p in slice_flat(groups, offset, part))
            self.tensors[name] = GatheredTensor(pieces, tuple(shape))
            offset += part
        if offset != per_rank[0]:
            raise ValueError(
                f"parameters take {offset * world_size} elements, the ranks hold {per_rank[0] * world_size}"
            )


def checked_shapes(group, file: Path, key: str) -> dict[str, tuple[int, ...]]:
    """A `param_shapes` group (name -> shape) whose shapes are made of non-negative ints, as DeepSpeed writes them."""
    if not isinstance(group, dict):
        raise InputError(file, f"{key} is a {type(group).__name__}, not a map of parameter names to shapes")
    shapes = {}
    for name, shape in group.items():
        dims = tuple(shape) if isinstance(shape, (list, tuple, torch.Size)) else None
        if not isinstance(name, str) or dims is None or not all(type(n) is int and n >= 0 for n in dims):
            raise InputError(file, f"{key}: parameter {name!r} has shape {shape!r}, not a list of sizes"[:300])
        shapes[name] = dims
    return shapes


def _flat(tensor: LazyTensor) -> LazyTensor:
    return LazyTensor(tensor.file, tensor.offset, tensor.dtype, (tensor.numel,))


@register
class TrainerCheckpointReader(CheckpointReader):
    """A Trainer `checkpoint-N/`: the saved 16-bit weights when present and non-empty, else `global_stepN/`
    (named by the `latest` file) - what ZeRO-3 leaves with stage3_gather_16bit_weights_on_model_save=false."""

    layout = "trainer-checkpoint"

    def __init__(self, path: Path):
        super().__init__(path)
        for weights in (SafetensorsReader, TorchBinReader):
            if LAYOUTS[weights.layout].detect(path):
                inner = weights(path)
                if any(t.numel for t in inner.tensors.values()):  # ZeRO-3 without gathering saves placeholders
                    self.tensors, self.notes = inner.tensors, [f"gathered {weights.layout} weights", *inner.notes]
                    return
        tag_file = path / "latest"
        tag = tag_file.read_text().strip() if tag_file.is_file() else None
        steps = [path / tag] if tag else sorted(path.glob(ZERO_STEPS), key=natural_key)[-1:]
        if not steps or not steps[0].is_dir():
            raise InputError(tag_file, f"names {tag!r}, which is not a folder here")
        inner = ZeroReader(steps[0])
        self.tensors = inner.tensors
        self.notes = [f"no gathered weights: read {steps[0].name}/", *inner.notes]
