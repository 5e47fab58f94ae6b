"""Trains a tiny D-Attn model with DeepSpeed and saves what DeepSpeed writes: the real checkpoint fixtures.

Launched as users launch training, by DeepSpeed's own launcher (CPU accelerator, gloo, N local ranks):

    deepspeed --num_gpus N tests/helpers/deepspeed_training.py PLAN.json

PLAN.json is a list of runs; each trains a fresh model for two optimizer steps and saves into its `out`
folder. Run kinds:
  * "engine": `deepspeed.initialize` + `engine.save_checkpoint(out)` (a `global_stepN/` folder);
  * "trainer": `transformers.Trainer` with `deepspeed=` config, `save_steps` -> `out/checkpoint-N/`;
  * "released": the released fine-tuning (Vidi1.5_9B/vidi/train): `requires_grad_(False)` then selected modules
    trainable, one optimizer group per (module family, decay), `trainer.save_model(out)`.
Every run also writes `out/../<name>.truth.safetensors` on rank 0: the parameters as the trained module holds
them (gathered under ZeRO-3), the reference for tensors that have no fp32 master (frozen ones).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
import transformers
from deepspeed.accelerator import get_accelerator
from safetensors.torch import save_file

from dattn_export.checkpoints.released import released_config
from dattn_export.checkpoints.source import saved_state_dict
from dattn_export.demo_model import write_towers
from dattn_export.modeling.modeling_dattn import MODEL_CLASSES
from dattn_export.presets import randomize_weights, tiny_config

STEPS, BATCH, LENGTH = 2, 2, 12
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_model(run: dict):
    """The run's tiny model (Gemma 2, tied embeddings, unless it says otherwise), its vision tower frozen."""
    released = run["kind"] == "released"  # the released models carry an audio tower
    config = tiny_config(
        run.get("family", "gemma2"), audio=released, tie_word_embeddings=run.get("tied", True), **run.get("config", {})
    )
    model = randomize_weights(MODEL_CLASSES[config.model_type](config), seed=0)
    model.model.mm_vis.requires_grad_(False)
    return model


def batches(config, count: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    size = config.vision_config["image_size"]
    for _ in range(count):
        ids = torch.randint(3, config.vocab_size, (BATCH, LENGTH), generator=generator)
        yield {"input_ids": ids, "pixel_values": torch.randn(BATCH, 1, 3, size, size, generator=generator)}


def next_token_loss(model, input_ids, pixel_values):
    logits = model(input_ids, pixel_values.to(next(model.parameters()).dtype)).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


def ds_config(run: dict) -> dict:
    precision = run["precision"]
    zero = {"stage": run["stage"]}
    if run["stage"] == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = run.get("gather", True)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def save_truth(model, file: Path) -> None:
    """The module's parameters as trained (16-bit where the run is), gathered from the ZeRO-3 partitions."""
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=any(hasattr(p, "ds_id") for p in params)):
        if torch.distributed.get_rank() == 0:
            state = saved_state_dict(model)
            save_file({n: t.detach().clone().contiguous() for n, t in state.items()}, file)


def train_engine(run: dict, out: Path) -> None:
    model = build_model(run)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(run))
    for batch in batches(model.config, STEPS, seed=torch.distributed.get_rank()):
        engine.backward(next_token_loss(engine, **batch))
        engine.step()
    engine.save_checkpoint(str(out))
    save_truth(engine.module, out.parent / f"{out.name}.truth.safetensors")


class CausalLMTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return next_token_loss(model, **inputs)


class ReleasedTrainer(CausalLMTrainer):
    """The released VidiTrainer's optimizer: decay / no-decay groups for the LLM and for each mm module."""

    def create_optimizer(self):
        decay = set(transformers.trainer_pt_utils.get_parameter_names(self.model, [torch.nn.LayerNorm]))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        families = [None, "mm_rand", "mm_vis", "mm_aud"]
        groups = []
        for family in families:
            for with_decay in (True, False):
                params = [
                    p
                    for n, p in named
                    if (n in decay) == with_decay and (family in n if family else not any(f in n for f in families[1:]))
                ]
                groups.append({"params": params, "weight_decay": self.args.weight_decay if with_decay else 0.0})
        self.optimizer = torch.optim.AdamW(groups, lr=self.args.learning_rate)
        return self.optimizer


def train_with_trainer(run: dict, out: Path) -> None:
    model = build_model(run)
    if run["kind"] == "released":  # train.py: everything frozen, then the projector/norms and the LLM
        model.requires_grad_(False)
        for name, param in model.named_parameters():
            if "mm_rand" in name or not name.startswith("model.mm_"):
                param.requires_grad_(True)
    precision = run["precision"]
    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        save_steps=STEPS,
        save_strategy="no" if run["kind"] == "released" else "steps",
        learning_rate=1e-2,
        weight_decay=0.1,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        deepspeed=ds_config(run),
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    data = list(batches(model.config, STEPS * torch.distributed.get_world_size(), seed=0))
    dataset = [{k: v[i] for k, v in b.items()} for b in data for i in range(BATCH)]
    trainer_class = ReleasedTrainer if run["kind"] == "released" else CausalLMTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=dataset)
    trainer.train()
    if run["kind"] == "released":
        trainer.save_state()
        trainer.save_model(str(out))
        if torch.distributed.get_rank() == 0:  # Vidi's config class writes the released keys and tower paths
            vision, audio = write_towers(out.parent / "towers", model.config)
            (out / "config.json").write_text(json.dumps(released_config(model.config, str(vision), str(audio))))
    save_truth(trainer.model_wrapped.module, out.parent / f"{out.name}.truth.safetensors")


def main(plan_file: str) -> None:
    # DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fp16 kernels (AVX512-FP16 / AMX); without
    # them its sanity check refuses fp16 although PyTorch computes it. The fp16 runs need that check skipped:
    # the optimizer, loss scaler and checkpoint code they exercise are DeepSpeed's own.
    get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo")
    for run in json.loads(Path(plan_file).read_text()):
        out = Path(run["out"])
        (train_engine if run["kind"] == "engine" else train_with_trainer)(run, out)
        if run["kind"] == "engine" and torch.distributed.get_rank() == 0:  # the config a user keeps beside it
            build_model(run).config.save_pretrained(out)
        torch.distributed.barrier()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[-1])
