"""Tiny models, inputs and checkpoint folders for the tests."""

import json
import os

import torch
import transformers
from safetensors.torch import save_file

from dattn_export.checkpoints.released import released_config, released_fields
from dattn_export.checkpoints.source import config_from_dict, saved_state_dict
from dattn_export.demo_model import build_tokenizer, save_tokenizer, write_demo_checkpoint
from dattn_export.media import open_image
from dattn_export.modeling.images import prepare_pictures
from dattn_export.modeling.modeling_dattn import MODEL_CLASSES
from dattn_export.presets import randomize_weights, tiny_config
from dattn_export.processing import load_image_processor


def build_model(family: str, seed: int = 0, **overrides):
    config = tiny_config(family, **overrides)
    return randomize_weights(MODEL_CLASSES[config.model_type](config), seed).eval()


def transformers_llm(model):
    """transformers' own causal LM of the model's family with the same LLM weights (names are identical)."""
    prefix = model.config.family.prefix
    config_class, model_class = getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")
    fields = {k: v for k, v in model.config.to_dict().items() if k in config_class.__dataclass_fields__}
    hf = model_class(config_class(**fields, attn_implementation="eager")).eval()
    llm_weights = {k: v for k, v in saved_state_dict(model).items() if not k.startswith("model.mm_")}
    missing, unexpected = hf.load_state_dict(llm_weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


def left_padded_batch(lengths: list[int], vocab: int = 512, seed: int = 0):
    """(input_ids, attention_mask) for prompts of the given lengths, left-padded with token 0."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, vocab, (n,), generator=generator)
        mask[row, width - n :] = 1
    return ids, mask


def images(batch: int, count: int = 1, seed: int = 1, size: int = 32):
    return torch.randn(batch, count, 3, size, size, generator=torch.Generator().manual_seed(seed))


class Payload:
    """A pickle that runs `touch` when unpickled by anything that executes pickled code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def model_and_tensors(family="gemma2", seed=0):
    model = build_model(family, seed=seed)
    return model, saved_state_dict(model)


def write_hf(folder, model, tensors, fmt="safetensors", shards=2):
    """fmt: safetensors, bin (torch.save zip), or legacy-bin (the pre-1.6 non-zip torch format)."""
    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    save_tokenizer(build_tokenizer(model.config.vocab_size, model.config.family.name), folder)
    names = list(tensors)
    parts = [names[i::shards] for i in range(shards)]
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    files = (
        [f"{stem}.{ext}"] if shards == 1 else [f"{stem}-{k:05d}-of-{shards:05d}.{ext}" for k in range(1, shards + 1)]
    )
    for file, part in zip(files, parts):
        shard = {n: tensors[n].contiguous() for n in part}
        if fmt == "safetensors":
            save_file(shard, folder / file, metadata={"format": "pt"})
        else:
            torch.save(shard, folder / file, _use_new_zipfile_serialization=fmt == "bin")
    if shards > 1:
        weight_map = {n: f for f, part in zip(files, parts) for n in part}
        (folder / f"{stem}.{ext}.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def checkpoint_of(model, folder):
    """A checkpoint folder (tokenizer and all) holding `model`'s weights."""
    write_demo_checkpoint(folder, model.config.family.name)
    for shard in folder.glob("model*.safetensors*"):
        shard.unlink()
    save_file(saved_state_dict(model), folder / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    return folder


def released_model(family: str, seed: int = 0, window: int = 6, **preset):
    """A tiny model whose config went through what a released config.json says (the released semantics); `preset`:
    tiny_config's switches (video=True for a video model). The sliding window is shorter than the tests' prompts."""
    config = tiny_config(family, audio=True, sliding_window=window, mm_std=0.5, **preset)
    fields = released_config(config, "towers/tiny-siglip", "towers/tiny-whisper")
    fields |= {"vision_config": config.vision_config, "audio_config": config.audio_config}
    released = config_from_dict(released_fields(fields, "config.json"), "config.json")
    return randomize_weights(MODEL_CLASSES[released.model_type](released), seed).eval()


GRID_POINTS = [[1, 2], [2, 1], [2, 2]]
KINDS = {  # a converted folder of each kind of model: the demo's, as the released training code saves it
    "image": {},
    "anyres": {"mm_image_aspect_ratio": "anyres", "mm_image_grid_points": GRID_POINTS},
    "video": {"video": True},
}


def picture_pixels(path, config, folder) -> torch.Tensor:
    """A picture file as the CLI prepares it for a model of `config` whose processor is `folder`'s: (1, 1, 3, H, W)
    pixel values, by the released code's aspect rule (not anyres, whose pictures become tiles)."""
    return prepare_pictures([open_image(path)], config.mm_image_aspect_ratio, load_image_processor(folder, config))[
        None
    ]


def demo_folders(root):
    """(family, kind) -> a converted demo folder of that kind (KINDS), written under `root` at its first use."""
    from dattn_export.stages.convert import convert

    made = {}

    def folder(family: str, kind: str):
        if (family, kind) not in made:
            checkpoint = write_demo_checkpoint(root / family / kind / "checkpoint", family, **KINDS[kind])
            made[family, kind] = convert(checkpoint, root / family / kind / "converted").out
        return made[family, kind]

    return folder
