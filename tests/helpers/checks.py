"""Comparisons the tests share."""

import numpy as np
import torch
from safetensors.torch import load_file

from .builders import images, left_padded_batch

ATOL = 1e-4  # ONNX Runtime against the reference, fp32 logits


def assert_converted_equals(out, expected):
    tensors = {}
    for shard in out.glob("*.safetensors"):
        tensors.update(load_file(shard))
    assert set(tensors) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(tensors[name], tensor), name


# (batch, new text tokens, past text tokens, images)
SHAPES = [(1, 1, 0, 1), (3, 52, 0, 2), (3, 1, 41, 1), (1, 55, 44, 2)]


def run_case(model, runtime, batch, new, past, num_images, seed):
    lengths = [past + new - 5 * row for row in range(batch)]  # left padding grows down the batch
    ids, mask = left_padded_batch(lengths, seed=seed)
    pixels = images(batch, num_images, seed=seed)
    with torch.no_grad():
        expected = model(ids, pixels, mask).logits[:, past:]
        past_kv = model(ids[:, :past], pixels, mask[:, :past]).past_key_values if past else None
    visual, context_mask = runtime.encode_images(pixels.numpy())
    past_np = [t.numpy() for kv in past_kv for t in kv] if past else runtime.empty_kv(batch)
    logits, present = runtime.decode(ids[:, past:].numpy(), mask.numpy(), past_np, visual, context_mask)
    keep = mask[:, past:].bool().numpy()
    error = np.abs(logits[keep] - expected.numpy()[keep]).max()
    assert error <= ATOL, f"batch {batch}, {new} new, {past} past, {num_images} images: max abs error {error:.2e}"
    assert present[0].shape[2] == past + new
    return error


def context_segments(batch: int, lengths: list[int], generator: torch.Generator | None = None) -> torch.Tensor:
    """(batch, sum(lengths)) int64 segment ids of context keys laid end to end, as a video model's [frames ; audio]:
    segment i+1 over lengths[i] keys. The last row pads the end of each segment (0) and, with two segments or more,
    has no keys of segment 2 (a sample without audio); with a `generator` the order of the keys is shuffled (the
    contract does not assume segments are contiguous)."""
    ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)]).repeat(batch, 1)
    ends = torch.tensor(lengths).cumsum(0)
    for end, n in zip(ends.tolist(), lengths):
        ids[-1, end - min(2, n - 1) : end] = 0
    if len(lengths) >= 2:
        ids[-1][ids[-1] == 2] = 0
    if generator is not None:
        ids = ids[:, torch.randperm(ids.shape[1], generator=generator)]
    return ids


# The released scripts' prompt around the media's marker for a question (their preprocess_chat over the family's chat
# template, the BOS text removed), written out: the text before the marker and after it
RELEASED_TURNS = {
    "mistral": ("[INST] ", "\n{question}[/INST]"),
    "gemma2": ("<start_of_turn>user\n", "\n{question}<end_of_turn>\n<start_of_turn>model\n"),
}


def released_question_ids(tokenizer, family: str, question: str) -> list[int]:
    """The ids the released scripts ask `question` about a picture or a video with (tokenizer_image_token: each side
    of the marker tokenized apart, the later side without its BOS)."""
    before, after = RELEASED_TURNS[family]
    return (
        tokenizer(before)["input_ids"]
        + tokenizer(after.format(question=question), add_special_tokens=False)["input_ids"]
    )
