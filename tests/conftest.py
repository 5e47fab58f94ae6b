import os

# Triton kernels run on CPU tensors through its interpreter where there is no GPU. Triton reads this once,
# at its first use, so it is set before anything imports it.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from dattn_export.modeling_dattn import MODEL_CLASSES
from dattn_export.presets import randomize_weights, tiny_config

torch.set_num_threads(2)


def build_model(family: str, seed: int = 0, **overrides):
    config = tiny_config(family, **overrides)
    return randomize_weights(MODEL_CLASSES[config.model_type](config), seed).eval()


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


@pytest.fixture(params=["mistral", "gemma2"])
def family(request):
    return request.param
