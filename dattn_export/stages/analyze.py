"""`analyze`: what the decomposed attention does with an image (or a video model's frames and audio) and a prompt,
layer by layer.

For every layer and text token: the attention mass on the visual stream, sigmoid(S_V - S_T) with S_* the
log-sum-exp of each segment's logits (for the alpha merge and for conventional attention exactly the share of
the softmax on visual keys; for the sum merge the share the alpha merge would give); a video model's audio stream
gets its share the same way. The prompt may mark where the image sits with `<image>`: text before it, the image,
and text after it give the MLLM-LAWS curves (mass of the tokens after the image on each part, per layer) and the
attention-shift score, 1 - Pearson(before, after). Heads are averaged. Writes report.json, visual_mass.png
(layers x tokens) and laws.png.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..artifacts import atomic_dir
from ..checkpoints.source import build_model, open_source
from ..errors import InputError
from ..extras import require
from ..folders import check_output
from ..media import decode_media, encode_media
from ..media_options import Media
from ..modeling.attention import dattn_op, segment_shares
from ..modeling.marked_prompts import media_marker, prompt_ids
from ..modeling.streams import AUDIO
from ..plugins.contract import using_op
from ..processing import load_processor
from ..prompts import PROMPT_KINDS, Prompt, as_prompt

PLOT_SIZE = {"visual_mass.png": (1200, 600), "laws.png": (900, 500)}  # pixels, at 100 dpi


@dataclass
class AttentionReport:
    merge: str
    tokens: list[str]
    image_after_token: int  # text tokens before the image
    visual_mass: list[list[float]]  # [layer][token]
    laws: dict[str, list[float]]  # before / image / after (/ audio) -> per layer
    attention_shift: float | None
    audio_mass: list[list[float]] | None = None  # [layer][token]; None: no audio stream


def layer_masses(call: dict, attention, image_after: int) -> torch.Tensor:
    """(N + 2, T): mean over heads of the softmax mass on [visual, (a video model's audio,) text before the image,
    text after it]."""
    q, k = call["q"], call["k"]
    before = torch.arange(k.shape[2]) < image_after + (k.shape[2] - q.shape[2])
    shares = segment_shares(
        q,
        k,
        call["key_mask"],
        call["q_vis"],
        call["k_vis"],
        call["context_mask"],
        scale=attention.scale,
        softcap=attention.softcap,
        window=attention.window,
        causal_context=attention.causal_context,
        num_contexts=attention.num_contexts,
        text_split=before,
    )
    return shares.mean(dim=1)[0].T  # batch of one


def pearson(a: np.ndarray, b: np.ndarray) -> float | None:
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


@torch.no_grad()
def analyze(checkpoint: Path, media: Media, prompt: str | Prompt, out: Path, force: bool = False) -> AttentionReport:
    source = open_source(checkpoint)
    check_output(out, force, source.inputs())
    prompt = as_prompt(prompt)
    media.check(source.config, prompt)
    if not (media.images or media.video or media.frames):
        raise InputError("--image", "nothing to analyze: pass an image (a video model: --video or --frames)")
    processor = load_processor(checkpoint, source.config)
    tokenizer, decoded = processor.tokenizer, decode_media(media, processor, [prompt])
    text = prompt.text_for(tokenizer, source.config.family, media=True, length=decoded.duration)
    model = build_model(source)
    marker = media_marker(text)
    before_text = text.partition(marker)[0] if marker else ""
    image_after = len(tokenizer(before_text)["input_ids"])  # with no marker, only the BOS token comes before it
    ids = prompt_ids(tokenizer, text)
    if len(ids) == image_after:
        raise InputError(PROMPT_KINDS[prompt.kind], "has no text after the image: nothing attends to it")
    streams = encode_media(model, processor, decoded, {})
    heard = "context_mask" in streams and bool((streams["context_mask"] == AUDIO.segment).any())
    calls = []  # every attention call's inputs, layer by layer

    def recording_op(q, k, v, key_mask, q_vis, k_vis, v_vis, context_mask, **keywords):
        calls.append(dict(q=q, k=k, key_mask=key_mask, q_vis=q_vis, k_vis=k_vis, context_mask=context_mask))
        return dattn_op(q, k, v, key_mask, q_vis, k_vis, v_vis, context_mask, **keywords)

    with using_op(model, recording_op):
        model(torch.tensor([ids]), **streams)
    attentions = [layer.self_attn for layer in model.model.layers]
    masses = torch.stack(
        [layer_masses(call, attention, image_after) for call, attention in zip(calls, attentions, strict=True)]
    )  # (L, 3 or 4, T): visual, (audio,) before, after
    after = masses[:, :, image_after:].mean(dim=2).numpy()  # the tokens after the image, averaged
    shift = pearson(after[:, -2], after[:, -1])
    laws = {"before": after[:, -2].tolist(), "image": after[:, 0].tolist(), "after": after[:, -1].tolist()}
    report = AttentionReport(
        merge=model.config.merge,
        tokens=tokenizer.convert_ids_to_tokens(ids),
        image_after_token=image_after,
        visual_mass=masses[:, 0].tolist(),
        laws=laws | ({"audio": after[:, 1].tolist()} if heard else {}),
        attention_shift=None if shift is None else 1.0 - shift,
        audio_mass=masses[:, 1].tolist() if heard else None,
    )
    with atomic_dir(out, overwrite=force, reading=source.inputs()) as tmp:
        (tmp / "report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
        plot(report, tmp)
    return report


def plot(report: AttentionReport, folder: Path) -> None:
    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mass = np.array(report.visual_mass)
    fig, ax = plt.subplots(figsize=tuple(n / 100 for n in PLOT_SIZE["visual_mass.png"]), dpi=100)
    image = ax.imshow(mass, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set(xlabel="text token", ylabel="layer", title="attention mass on the visual stream, sigmoid(S_V - S_T)")
    ax.set_xticks(range(len(report.tokens)), [t.replace("Ġ", " ") for t in report.tokens], rotation=90, fontsize=6)
    ax.set_yticks(range(len(mass)))
    if report.image_after_token:
        ax.axvline(report.image_after_token - 0.5, color="white", linestyle="--", linewidth=1)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(folder / "visual_mass.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=tuple(n / 100 for n in PLOT_SIZE["laws.png"]), dpi=100)
    layers = range(len(report.laws["image"]))
    labels = {"before": "text before the image", "image": "the image", "after": "text after it", "audio": "the audio"}
    for part, style in zip(report.laws, ("o-", "s-", "^-", "d-")):
        ax.plot(layers, report.laws[part], style, label=labels[part])
    shift = "n/a" if report.attention_shift is None else f"{report.attention_shift:.3f}"
    ax.set(
        xlabel="layer",
        ylabel="attention mass",
        ylim=(0, 1),
        xticks=list(layers),
        title=f"MLLM-LAWS (attention shift {shift})",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "laws.png", dpi=100)
    plt.close(fig)
