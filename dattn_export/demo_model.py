"""The built-in tiny demo model: a random-weight D-Attn checkpoint in the layout of a real training output, its
prompts and its media (a picture, a video file with a sound track). The demo command, validate's defaults, the
tests and the benchmarks build from here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import CLIPVisionConfig, PreTrainedTokenizerFast, SiglipVisionConfig, WhisperConfig

from .checkpoints.released import OWN_KEYS, released_config
from .checkpoints.safetensors_writer import PlannedTensor, plan_shards, write_shards
from .checkpoints.source import saved_state_dict
from .modeling.families import DEFAULT_FAMILY, FAMILIES
from .modeling.modeling_dattn import MODEL_CLASSES
from .modeling.processing_dattn import default_audio_processor
from .modeling.sound_decoding import AUDIO_RATE
from .presets import randomize_weights, tiny_config
from .processing import IMAGE_PROCESSORS
from .prompts import Prompt, asked

DEMO_QUESTIONS = {  # by what the model takes (its modality)
    "image": "Describe the image in one sentence.",
    "video": "What happens in the video, and what do you hear?",
}
DEMO_VIDEO_FPS = 2  # the file's rate: generate takes one frame a second
TOWER_FOLDER_SUFFIX = {"image": "", "video": "-video"}  # a video model's tower: smaller frames
SHARD_BYTES = 256 * 1024  # small, so the demo checkpoint has several shards like a real one

DEMO_TURNS = [  # questions about the demo's picture and their answers (the accuracy gate's tests train on them)
    (DEMO_QUESTIONS["image"], "A red circle on a blue and green gradient."),
    ("What is in the picture?", "There is a round shape in the middle of the picture."),
    ("How many objects are there?", "One object, a circle, near the center."),
]
CORPUS = [  # the texts the demo's tokenizer learns its merges from
    *(f"USER: {question}\nASSISTANT: {answer}" for question, answer in DEMO_TURNS),
    "The quick brown fox jumps over the lazy dog. Vision and text tokens attend differently.",
    "Decomposed attention: visual tokens see themselves, text tokens see the image and earlier text.",
]


def demo_prompt(modality: str, tokenizer) -> Prompt:
    """The demo's question about its media (validate's default), as the checkpoint is asked it (`prompts.asked`)."""
    return asked(DEMO_QUESTIONS[modality], tokenizer)


def supervised_batch(rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training rows of (prompt ids, answer ids) as the demo's models are trained on them: left-padded ids, their
    mask, and labels on the answers alone (-100 elsewhere)."""
    longest = max(len(p) + len(a) for p, a in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (prompt, reply) in enumerate(rows):
        start = longest - len(prompt) - len(reply)
        ids[i, start:] = torch.tensor(prompt + reply)
        mask[i, start:] = 1
        labels[i, start + len(prompt) :] = torch.tensor(reply)
    return ids, mask, labels


def build_tokenizer(
    vocab_size: int, family: str = DEFAULT_FAMILY, texts: list[str] = CORPUS
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on a few sentences (`texts`): encodes any text, needs no download; with the
    family's chat template and its turns' special tokens (ids 3 on), as its released model's tokenizer has them."""
    chat = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", *chat.chat_tokens],  # ids 0, 1, 2 as in the config
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="left",
        chat_template=chat.chat_template,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """The tokenizer as the released training code's transformers 4.x saved it: its chat template inside
    tokenizer_config.json, its class by the name transformers 4 and 5 both load (5 writes TokenizersBackend), its
    merges as "a b" strings (tokenizers before 0.20, which transformers 4.44 pins, reads no pairs)."""
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    edits = {
        "tokenizer_config.json": lambda fields: fields | {"tokenizer_class": "PreTrainedTokenizerFast"},
        "tokenizer.json": lambda fields: fields | {
            "model": fields["model"] | {"merges": [" ".join(pair) for pair in fields["model"]["merges"]]}
        },
    }  # fmt: skip
    for name, edit in edits.items():
        path = Path(folder) / name
        path.write_text(json.dumps(edit(json.loads(path.read_text())), ensure_ascii=False, indent=2) + "\n")


def demo_image(size: int = 64) -> Image.Image:
    y, x = np.mgrid[0:size, 0:size] / (size - 1)
    pixels = np.stack([x * 0.2, y * 0.8, 1 - y * 0.6], axis=-1)
    image = Image.fromarray((pixels * 255).astype(np.uint8))
    ImageDraw.Draw(image).ellipse([size // 4, size // 4, 3 * size // 4, 3 * size // 4], fill=(220, 30, 30))
    return image


def demo_frames(count: int = 12, size: int = 64) -> list[np.ndarray]:
    """(size, size, 3) uint8 frames: the demo picture's circle crossing it from left to right."""
    frames = []
    for i in range(count):
        image = demo_image(size)
        draw, left = ImageDraw.Draw(image), i * (size - size // 3) // max(count - 1, 1)
        draw.rectangle([0, 0, size, size], fill=(30, 60 + 10 * i, 200))
        draw.ellipse([left, size // 3, left + size // 3, 2 * size // 3], fill=(220, 30, 30))
        frames.append(np.asarray(image))
    return frames


def demo_audio(seconds: float, rate: int = AUDIO_RATE) -> np.ndarray:
    """16-bit mono samples: a tone rising from 200 Hz to 2 kHz."""
    t = np.arange(int(seconds * rate)) / rate
    frequency = 200 + 1800 * t / seconds
    return (np.sin(2 * np.pi * np.cumsum(frequency) / rate) * 9000).astype(np.int16)


def write_video(path: Path, frames: list[np.ndarray], fps: int, samples: np.ndarray | None, rate: int = AUDIO_RATE):
    """A QuickTime file of lossless frames (PNG) and, unless None, 16-bit mono PCM samples: what PyAV decodes exactly,
    so a test can know every pixel and sample the reader gets."""
    import av

    height, width = frames[0].shape[:2]
    with av.open(str(path), "w", format="mov") as container:
        video = container.add_stream("png", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "rgb24"
        audio = None if samples is None else container.add_stream("pcm_s16le", rate=rate, layout="mono")
        for frame in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(video.encode())
        if audio is not None:
            frame = av.AudioFrame.from_ndarray(samples[None], format="s16", layout="mono")
            frame.sample_rate = rate
            container.mux(audio.encode(frame))
            container.mux(audio.encode())


def write_towers(folder: Path, config) -> tuple[Path, Path]:
    """The tower folders a released checkpoint names (config and preprocessor, as the tower's Hub folder has them;
    their weights are in the checkpoint): (vision tower, audio tower)."""
    kind = "clip" if config.vision_config["model_type"] == "clip_vision_model" else "siglip"
    vision = folder / f"tiny-{kind}{TOWER_FOLDER_SUFFIX[config.modality]}"
    audio = folder / "tiny-whisper"
    size, processor = config.vision_config["image_size"], IMAGE_PROCESSORS[config.vision_config["model_type"]]
    if kind == "clip":  # CLIP resizes the shortest edge, then crops the centre
        CLIPVisionConfig(**config.vision_config).save_pretrained(vision)
        processor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(vision)
    else:
        SiglipVisionConfig(**config.vision_config).save_pretrained(vision)
        processor(size={"height": size, "width": size}).save_pretrained(vision)
    WhisperConfig(**config.audio_config).save_pretrained(audio)
    default_audio_processor(config.audio_config).save_pretrained(audio)  # its chunk: the tiny encoder's input
    return vision.absolute(), audio.absolute()


def write_demo_checkpoint(
    out: Path,
    family: str = DEFAULT_FAMILY,
    seed: int = 0,
    video: bool = False,
    tokenizer_texts: list[str] = CORPUS,
    **config_overrides,
) -> Path:
    """A checkpoint as the released training code (bytedance/vidi) saves it: its config.json keys (the towers named
    by folders, written beside in `towers/`), sharded safetensors with its names and shapes (the Whisper audio tower
    included), tokenizer and generation config; plus a sample image (demo.png). Overrides of this project's own
    switches (attention modes, WINGS learners), which the released code cannot express, and families with no released
    model give our config format.
    `video`: a video model (frames and audio) as the family's released video model; `tokenizer_texts`: what its
    tokenizer learns its words from."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if FAMILIES[family].released_model is None:  # attends as the released models do, so vLLM serves it too
        config_overrides = {"dattn_mode": "dattn-sum", **config_overrides}
    config = tiny_config(family, audio=True, video=video, mm_std=0.5, **config_overrides)
    model = randomize_weights(MODEL_CLASSES[config.model_type](config), seed).eval()
    planned = [
        PlannedTensor(name, t.dtype, tuple(t.shape), produce=lambda _buffer, t=t: t)
        for name, t in saved_state_dict(model).items()
    ]
    write_shards(plan_shards(planned, SHARD_BYTES), out)
    vision, audio = write_towers(out.parent / "towers", config)
    if set(config_overrides) & set(OWN_KEYS) or config.family.released_model is None:
        config.save_pretrained(out)
    else:
        fields = released_config(config, str(vision), str(audio))
        (out / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    save_tokenizer(build_tokenizer(config.vocab_size, family, tokenizer_texts), out)
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_new_tokens": 16, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    demo_image().save(out / "demo.png")  # video models: a demo.mov beside
    if video:
        frames = demo_frames()
        write_video(out / "demo.mov", frames, DEMO_VIDEO_FPS, demo_audio(len(frames) / DEMO_VIDEO_FPS))
    return out
