"""Checkpoint folders in the layouts and spellings the loader accepts give the same model."""

import json

import torch
from helpers.builders import build_model, images, left_padded_batch
from safetensors.torch import save_file

from dattn_export.checkpoints.source import load_model, saved_state_dict


def save_folder(model, folder, tensors, writer):
    folder.mkdir()
    model.config.save_pretrained(folder)
    writer(tensors, folder)
    return folder


def logits(model):
    ids, mask = left_padded_batch([5, 3])
    with torch.no_grad():
        return model(ids, images(2), mask).logits


def test_transformers5_tower_names_load(tmp_path, family):
    """transformers 5.x towers have no `vision_model` wrapper; both spellings are the same tensor."""
    model = build_model(family)
    tensors = {k.replace("mm_vis.vision_model.", "mm_vis."): v for k, v in saved_state_dict(model).items()}
    assert any(k.startswith("model.mm_vis.embeddings.") for k in tensors)
    folder = save_folder(model, tmp_path / "ckpt", tensors, lambda t, d: save_file(t, d / "model.safetensors"))
    torch.testing.assert_close(logits(load_model(folder)), logits(model), atol=0, rtol=0)


def test_sharded_bin_loads(tmp_path):
    model = build_model("gemma2")
    tensors = saved_state_dict(model)
    names = list(tensors)

    def write_bin(t, d):
        halves = {"pytorch_model-00001-of-00002.bin": names[:50], "pytorch_model-00002-of-00002.bin": names[50:]}
        for file, part in halves.items():
            torch.save({n: t[n].clone() for n in part}, d / file)
        index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
        (d / "pytorch_model.bin.index.json").write_text(json.dumps(index))

    folder = save_folder(model, tmp_path / "ckpt", tensors, write_bin)
    assert "lm_head.weight" not in tensors  # Gemma 2 ties it to the embeddings: stored once
    torch.testing.assert_close(logits(load_model(folder)), logits(model), atol=0, rtol=0)


def test_views_of_shared_storage_read_lazily(tmp_path):
    """torch.save keeps views (transposes, slices, tied tensors) as offsets and strides into one storage."""
    from dattn_export.checkpoints.lazy import read_torch_file

    base = torch.arange(60.0).reshape(6, 10)
    views = {"transposed": base.t()[2:5], "window": base[1:4, 2:7], "same": base, "empty": base[:0]}
    torch.save(views, tmp_path / "views.pt")
    for name, lazy in read_torch_file(tmp_path / "views.pt").items():
        assert torch.equal(lazy.load(), views[name]), name
