"""Run ByteDance's Vidi code (outside the project) as an oracle on CPU: build a tiny random model with its own
classes, save it as its trainer does (sharded bf16 safetensors), and record its logits for image, text-only and
mixed-batch prompts; with `video`, a video model's (frames and audio, samples without one).
usage: VIDI_SRC=... python vidi_oracle.py {gemma2|mistral} OUT [video|anyres|clip-resize|clip-pad]  (see README.md)"""

import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import torch

family, out = sys.argv[1], Path(sys.argv[2])
video, anyres = sys.argv[3:] == ["video"], sys.argv[3:] == ["anyres"]
# clip-resize / clip-pad: a CLIP tower (the released classes' default) and pictures prepared by the released
# process_images under that mm_image_aspect_ratio
picture_rule = sys.argv[3].removeprefix("clip-") if sys.argv[3:4] and sys.argv[3].startswith("clip-") else None
VIDI_SRC = os.environ["VIDI_SRC"]  # a checkout of github.com/bytedance/vidi
sys.path.insert(0, str(Path(__file__).parent))
import flash_standin

flash_standin.install()
import transformers.utils
import transformers.utils.import_utils as iu

for mod in (transformers.utils, iu):
    mod.is_flash_attn_2_available = lambda: True
    mod.is_flash_attn_greater_or_equal = lambda *a, **k: True
    mod.is_flash_attn_greater_or_equal_2_10 = lambda: True
from transformers import modeling_utils

modeling_utils.PreTrainedModel._check_and_enable_flash_attn_2 = classmethod(lambda cls, config, *a, **k: config)
import torch.distributed

ds = types.ModuleType("deepspeed")
ds.comm = torch.distributed
sys.modules["deepspeed"], sys.modules["deepspeed.comm"] = ds, torch.distributed
liger = types.ModuleType("liger_kernel")
lt = types.ModuleType("liger_kernel.transformers")
lm = types.ModuleType("liger_kernel.transformers.monkey_patch")
lm.apply_liger_kernel_to_gemma2 = lambda **k: None


class LigerRMSNorm(torch.nn.Module):
    pass


lm.LigerRMSNorm = LigerRMSNorm
lm.__all__ = ["apply_liger_kernel_to_gemma2", "LigerRMSNorm"]
sys.modules.update(
    {"liger_kernel": liger, "liger_kernel.transformers": lt, "liger_kernel.transformers.monkey_patch": lm}
)

from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    CLIPVisionModel,
    PreTrainedTokenizerFast,
    SiglipImageProcessor,
    SiglipVisionConfig,
    SiglipVisionModel,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperModel,
)

SHARED_TEXT = dict(  # as the project's tiny presets; the window is shorter than the prompts
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    sliding_window=8, max_position_embeddings=2048,
)  # fmt: skip
if family == "gemma2":
    root = f"{VIDI_SRC}/Vidi1.5_9B"
    sys.path.insert(0, root)
    shell = types.ModuleType("vidi.dataset")
    shell.__path__ = [root + "/vidi/dataset"]
    sys.modules["vidi.dataset"] = shell
    from vidi.constants import IMAGE_TOKEN_INDEX
    from vidi.dataset.img_utils import process_images
    from vidi.model.lmm.dattn.gemma import DattnGemma2Config as Config
    from vidi.model.lmm.dattn.gemma import DattnGemma2ForCausalLM as Model

    text = dict(
        **SHARED_TEXT,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )
else:
    root = f"{VIDI_SRC}/Vidi_7B"
    sys.path.insert(0, root)
    from model.constants import IMAGE_TOKEN_INDEX
    from model.img_utils import process_images
    from model.lmm.dattn.mistral import DattnMistralConfig as Config
    from model.lmm.dattn.mistral import DattnMistralForCausalLM as Model

    # Vidi_7B passes `past_audio_key_values=` (sic) to its layers; on a text-only prompt it reaches
    # MistralFlashAttention2.forward, which does not take it (a TypeError in its pinned 4.44.2): drop that None
    from transformers.models.mistral import modeling_mistral

    _forward = modeling_mistral.MistralFlashAttention2.forward
    modeling_mistral.MistralFlashAttention2.forward = lambda self, *a, past_audio_key_values=None, **k: _forward(
        self, *a, **k
    )
    text = dict(**SHARED_TEXT, num_key_value_heads=2, head_dim=16)

for stub in ("deepspeed", "deepspeed.comm"):  # Vidi's modules hold their reference; accelerate must not see it
    sys.modules.pop(stub)
torch.manual_seed(0)
towers = out / "towers"
vision_dir, audio_dir, base = towers / "siglip-tiny", towers / "whisper-tiny", out / "base"
size, patch = (28, 4) if video else (32, 8)  # video: 7 patches a side, pooled by 2
tower = dict(
    hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, image_size=size, patch_size=patch
)
if picture_rule:  # the released code picks the tower class by "clip" in its name
    vision_dir = towers / "clip-tiny"
    CLIPVisionModel(CLIPVisionConfig(**tower, projection_dim=48)).save_pretrained(vision_dir)
    CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(
        vision_dir
    )
else:
    SiglipVisionModel(SiglipVisionConfig(**tower)).save_pretrained(vision_dir)
    SiglipImageProcessor(size={"height": size, "width": size}).save_pretrained(vision_dir)
ac = WhisperConfig(
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    decoder_layers=1,
    decoder_attention_heads=2,
    decoder_ffn_dim=64,
    num_mel_bins=16,
    max_source_positions=30,
    vocab_size=100,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=1,
)
WhisperModel(ac).save_pretrained(audio_dir)
# its chunk: 60 mel frames, the tiny encoder's input (30 positions), as 3000 are Whisper's (1500 positions)
WhisperFeatureExtractor(feature_size=16, hop_length=8000).save_pretrained(audio_dir)
base.mkdir(parents=True, exist_ok=True)
from tokenizers import Tokenizer, models

tokenizer = PreTrainedTokenizerFast(  # any tokenizer: the prompts are given as ids
    tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}, unk_token="<unk>")),
    bos_token="<s>",
    eos_token="</s>",
    pad_token="<pad>",
    unk_token="<unk>",
)
tokenizer.save_pretrained(base)

config = Config(
    **text,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    mm_vision_tower=str(vision_dir),
    mm_audio_tower=str(audio_dir),
    mm_vision_select_layer=-2,
    mm_image_aspect_ratio="anyres" if anyres else picture_rule or "resize",
    mm_image_grid_points="[[1, 2], [2, 1], [2, 2]]",
    mm_input_type="video" if video else "image",
    mm_image_pool_size=2,
    mm_audio_pool_size=2,
    mm_splits=4 if video else 1,  # finetune.sh's; Vidi1.5_9B's video pool gets no size at 1 (a TypeError)
    mm_std=0.5,
    mm_time_interval=8 if video else 10000,
    loss_thres=None,
    train_rand=True,  # train.py sets these before training; the video path reads them
    train_vis=False,
    train_aud=False,
    train_llm=True,
)
config._name_or_path = str(base)
config._attn_implementation_internal = "flash_attention_2"
model = Model(config).eval()
g = torch.Generator().manual_seed(0)
with torch.no_grad():  # every weight matters: matrices ~ N(0, 1/fan_in), vectors around their neutral value
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if p.ndim >= 2:
            p.copy_(noise * p[0].numel() ** -0.5)
        elif "norm" in name and name.endswith("weight") and not (family == "gemma2" and "mm_" not in name):
            p.copy_(p * (1 + 0.1 * noise))
        else:
            p.copy_(0.1 * noise)
ckpt = out / "checkpoint"
import copy

with torch.no_grad():  # the weights the trainer's bf16 files hold; buffers (RoPE frequencies) stay fp32
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).float())
copy.deepcopy(model).to(torch.bfloat16).save_pretrained(ckpt, max_shard_size="300KB", safe_serialization=True)
tokenizer.save_pretrained(ckpt)

cases = {}
ids = torch.randint(3, 512, (2, 14), generator=g)
image_ids = torch.cat([ids[:, :1], torch.full((2, 1), IMAGE_TOKEN_INDEX), ids[:, 1:]], dim=1)  # <bos> <image> text
mask = torch.ones_like(image_ids)
if picture_rule:  # non-square pictures (a wide RGB, a tall RGBA, a wide greyscale) as files, opened as the released
    # dataset opens them, prepared by its process_images with the tower's own processor
    from PIL import Image

    (out / "pictures").mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for name, (width, height, mode) in {
        "wide": (80, 64, "RGB"),
        "tall": (47, 81, "RGBA"),
        "grey": (120, 50, "L"),
    }.items():
        data = rng.integers(0, 256, (height, width, {"RGB": 3, "RGBA": 4, "L": 1}[mode]), dtype=np.uint8)
        path = out / "pictures" / f"{name}.png"
        Image.fromarray(data.squeeze(-1) if mode == "L" else data, mode).save(path)
        picture = Image.open(path).convert("RGB")
        pixels = process_images([picture], model.get_model().image_processor, model.config)
        with torch.no_grad():
            logits = model(image_ids[:1], attention_mask=mask[:1], images=pixels, use_cache=False).logits
        cases[name] = (ids[:1], str(path), pixels, logits)
    torch.save({"cases": cases, "pictures": picture_rule}, out / "oracle.pt")
    print(family, f"pictures ({picture_rule}) saved", sorted(p.name for p in ckpt.iterdir()))
    sys.exit()
if anyres:  # a wide image (2 x 1 tiles) and a tall one (1 x 2), each a thumbnail plus its tiles; then no image
    tiles = [torch.randn(3, 3, size, size, generator=g) for _ in range(2)]
    sizes = [(70, 30), (30, 66)]
    with torch.no_grad():
        for name, t in {"anyres": tiles, "anyres_no_image_2nd": [tiles[0], torch.zeros_like(tiles[1])]}.items():
            logits = model(image_ids, attention_mask=mask, images=t, image_sizes=sizes, use_cache=False).logits
            cases[name] = (ids, t, sizes, logits)
    torch.save({"cases": cases, "anyres": True}, out / "oracle.pt")
    print(family, "anyres saved", sorted(p.name for p in ckpt.iterdir()))
    sys.exit()
if video:  # 3 and 2 frames; 2 and 1 log-mel chunks with 100 and 41 real frames
    frames = [torch.randn(n, 3, size, size, generator=g) for n in (3, 2)]
    mels = [torch.randn(n, 16, 60, generator=g) for n in (2, 1)]
    no_audio = [mels[0], torch.zeros(1, 16, 60)]  # the collator's stand-in for a sample without audio
    with torch.no_grad():
        for name, (f, a, n) in {
            "video_audio": (frames, mels, [100, 41]),
            "video_no_audio_2nd": (frames, no_audio, [100, 60]),
            "video_no_video_2nd": ([frames[0], torch.zeros_like(frames[1])], mels, [100, 41]),
        }.items():
            logits = model(image_ids, attention_mask=mask, images=f, audios=a, audio_sizes=n, use_cache=False).logits
            cases[name] = (ids, f, a, n, logits)
    torch.save({"cases": cases, "video": True}, out / "oracle.pt")
    print(family, "video saved", sorted(p.name for p in ckpt.iterdir()))
    sys.exit()
pixels = torch.randn(2, 3, 32, 32, generator=g)
with torch.no_grad():
    cases["image"] = (
        ids[:1],
        pixels[:1],
        model(image_ids[:1], attention_mask=torch.ones_like(image_ids[:1]), images=pixels[:1], use_cache=False).logits,
    )
    cases["text"] = (ids[:1], None, model(ids[:1], attention_mask=torch.ones_like(ids[:1]), use_cache=False).logits)
    mixed = pixels.clone()
    mixed[1] = 0  # a batch where the second sample has no image
    cases["batch_zero_image"] = (
        ids,
        mixed,
        model(image_ids, attention_mask=torch.ones_like(image_ids), images=mixed, use_cache=False).logits,
    )
    # greedy continuation by full forwards (no cache) of the image prompt
    seq = image_ids[:1]
    for _ in range(8):
        nxt = (
            model(seq, attention_mask=torch.ones_like(seq), images=pixels[:1], use_cache=False)
            .logits[:, -1]
            .argmax(-1, keepdim=True)
        )
        seq = torch.cat([seq, nxt], dim=1)
    greedy = seq[0, image_ids.shape[1] :].tolist()
torch.save({"cases": cases, "greedy": greedy}, out / "oracle.pt")
print(family, "saved", sorted(p.name for p in ckpt.iterdir()))
print(json.load(open(ckpt / "config.json")).get("architectures"))
