"""A prompt's text as the released code tokenizes it: the media's marker says where the picture or video sits, and
is cut out of the ids (the media are a context stream of their own, not tokens among the text). Plain Python, no
imports: the CLI checks prompts with it before torch is imported, and it ships in a Hub repo with the processor."""

from __future__ import annotations

import re

MEDIA_MARKERS = ("<image>", "<video>")  # where a prompt says its picture or video sits: text, cut out of the ids


def media_marker(prompt: str) -> str | None:
    """The media marker the prompt names (the first of MEDIA_MARKERS it holds), or None."""
    return next((marker for marker in MEDIA_MARKERS if marker in prompt), None)


def prompt_ids(tokenizer, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """The prompt's token ids as the released code makes them (Vidi's `tokenizer_image_token`, then its model's
    multimodal input preparation): the text before the media marker with the tokenizer's special tokens, each piece
    after one without, and the marker itself, which stands for the media's own stream, cut out. The released models
    were trained on `<image>` and a newline before the question (Vidi's one marker, for a picture or a video;
    `<video>` reads the same here)."""
    first, *rest = re.split("|".join(map(re.escape, MEDIA_MARKERS)), prompt)
    ids = tokenizer(first, add_special_tokens=add_special_tokens)["input_ids"]
    for piece in rest:
        ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids
