"""Writes DeepSpeed ZeRO-1/2/3 checkpoint folders in DeepSpeed's on-disk format, from a state dict.

The layout follows DeepSpeed's engine and its `zero_to_fp32` reader: `param_shapes` is a list of ordered
dicts (one per param group); ZeRO-1/2 optimizer files hold each group's flat fp32 buffer (padded to a
multiple of 2 x world size) cut into equal rank slices; ZeRO-3 files hold ceil(numel / world) elements of
every parameter per rank, zero-padded at the end. The pickles carry DeepSpeed's own objects (loss scaler,
stage enum): the real classes when DeepSpeed is installed, same-named stand-ins otherwise.
"""

from __future__ import annotations

import enum
import math
import sys
import types
from collections import OrderedDict
from pathlib import Path

import torch

try:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    HAVE_DEEPSPEED = True
except ImportError:  # stand-ins with DeepSpeed's qualified names, so the pickles reference the same globals
    HAVE_DEEPSPEED = False

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3
        max_stage = 3

    class LossScaler:
        def __init__(self, scale=1):
            self.cur_scale = scale
            self.dynamic = False

    for module_name, cls in (
        ("deepspeed.runtime.zero.config", ZeroStageEnum),
        ("deepspeed.runtime.fp16.loss_scaler", LossScaler),
    ):
        parts = module_name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        cls.__module__ = module_name
        setattr(sys.modules[module_name], cls.__name__, cls)


def _pieces(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """ZeRO-3: ceil(numel / world) elements per rank, the last zero-padded."""
    flat = tensor.detach().float().flatten()
    part = math.ceil(flat.numel() / world_size)
    flat = torch.cat([flat, flat.new_zeros(part * world_size - flat.numel())])
    return list(flat.split(part))


def write_zero_checkpoint(
    folder: Path,
    trainable: dict[str, torch.Tensor],
    *,
    stage: int,
    world_size: int,
    frozen: dict[str, torch.Tensor] | None = None,
    shared: dict[str, str] | None = None,
    groups: int = 2,
    bf16_prefix: bool = True,
) -> Path:
    """`trainable` become fp32 masters in the optimizer files; `frozen` go to the model states (as stored);
    `shared` maps alias -> source name."""
    folder.mkdir(parents=True)
    frozen, shared = frozen or {}, shared or {}
    names = list(trainable)
    cut = [round(i * len(names) / groups) for i in range(groups + 1)]
    param_groups = [OrderedDict((n, trainable[n].shape) for n in names[a:b]) for a, b in zip(cut, cut[1:])]
    common = dict(
        buffer_names=[],
        optimizer=None,
        lr_scheduler=None,
        sparse_tensor_module_names=set(),
        skipped_steps=0,
        global_steps=10,
        global_samples=80,
        dp_world_size=world_size,
        mp_world_size=1,
        ds_config={"train_batch_size": 8, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}},
        ds_version="0.19.8",
        param_shapes=param_groups,
        shared_params=dict(shared),
        frozen_param_shapes=OrderedDict((n, t.shape) for n, t in frozen.items()) or None,
    )
    prefix = "bf16_" if bf16_prefix else ""
    scaler = LossScaler(1.0)
    if stage < 3:
        module = {n: t.to(torch.bfloat16) for n, t in {**trainable, **frozen}.items()}
        torch.save(
            {**common, "module": module, "frozen_param_fragments": dict(frozen)}, folder / "mp_rank_00_model_states.pt"
        )
        align = 2 * world_size
        rank_groups: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        for shapes in param_groups:
            flat = torch.cat([trainable[n].detach().float().flatten() for n in shapes])
            flat = torch.cat([flat, flat.new_zeros(align * math.ceil(flat.numel() / align) - flat.numel())])
            for rank, part in enumerate(flat.chunk(world_size)):
                rank_groups[rank].append(part.clone())
        for rank in range(world_size):
            optimizer = dict(
                loss_scaler=scaler,
                dynamic_loss_scale=False,
                overflow=False,
                clip_grad=1.0,
                base_optimizer_state={"state": {}, "param_groups": [{"lr": 1e-5, "params": [0]}]},
                single_partition_of_fp32_groups=rank_groups[rank],
                zero_stage=ZeroStageEnum(stage),
                group_paddings=[0] * groups,
                partition_count=[world_size] * groups,
                ds_version="0.19.8",
            )
            torch.save(
                {"optimizer_state_dict": optimizer, "ds_config": common["ds_config"], "ds_version": "0.19.8"},
                folder / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            )
        return folder
    for rank in range(world_size):
        fragments = {n: _pieces(t, world_size)[rank].to(t.dtype) for n, t in frozen.items()}
        module = {n: torch.empty(0, dtype=torch.bfloat16) for n in {**trainable, **frozen}}
        torch.save(
            {**common, "module": module, "frozen_param_fragments": fragments},
            folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
        )
        flat_groups = [torch.cat([_pieces(trainable[n], world_size)[rank] for n in shapes]) for shapes in param_groups]
        optimizer = dict(
            zero_stage=ZeroStageEnum.weights,
            loss_scaler=scaler,
            dynamic_loss_scale=False,
            overflow=False,
            partition_count=world_size,
            fp32_flat_groups=flat_groups,
            optimizer_state_dict={"state": {0: {"exp_avg": torch.zeros_like(flat_groups[0])}}, "param_groups": []},
        )
        torch.save(
            {"optimizer_state_dict": optimizer, "ds_config": common["ds_config"], "ds_version": "0.19.8"},
            folder / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        )
    return folder
