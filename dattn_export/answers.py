"""What an answer's tokens say: their text, a byte that is no UTF-8 escaped rather than hidden, and a video answer's
time ranges as the released inference script prints them."""

from __future__ import annotations

import re

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens (Llama, Mistral, Gemma)


def answer_text(tokenizer, ids: list[int]) -> str:
    """The tokens' text; where their bytes are no UTF-8 (a random model's answer, or one cut inside a character),
    each such byte as a \\xNN escape instead of the replacement character, which would hide what was generated."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in text:
        return text
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_level = {char: byte for byte, char in bytes_to_unicode().items()}  # GPT-2's byte-level BPE alphabet

    def token_bytes(token: str) -> bytes:
        if match := BYTE_FALLBACK.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        if all(char in byte_level for char in token):
            return bytes(byte_level[char] for char in token)
        return token.replace("\u2581", " ").encode()  # SentencePiece's word start

    tokens = tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=True)  # None: past the vocabulary, no text
    return b"".join(token_bytes(t) for t in tokens if t is not None).decode("utf-8", errors="backslashreplace")


def seconds_ranges(text: str, duration: float, family) -> list[list[float]]:
    """An answer's "0.12-0.15" ranges (fractions of the video, read with the family's released pattern) in seconds
    of a video of `duration`; a match that is no number (the pattern allows "1.2.3") is skipped, where the released
    script would stop."""
    ranges = []
    for match in re.findall(family.released_range_pattern, text):
        try:
            ranges.append([float(fraction) * duration for fraction in match])
        except ValueError:
            continue
    return ranges


def time_ranges(text: str, duration: float, family) -> list[str]:
    """An answer's ranges as hh:mm:ss-hh:mm:ss, as the family's released inference script writes them for a video of
    `duration` seconds."""
    return [
        "-".join(clock(t, family.released_seconds_format) for t in pair)
        for pair in seconds_ranges(text, duration, family)
    ]


def clock(t: float, seconds_format: str) -> str:
    return f"{int(t / 3600):02d}:{(int(t) % 3600) // 60:02d}:" + seconds_format.format(int(t) % 60)
