"""Checkpoints DeepSpeed and the HF Trainer wrote themselves convert to exactly DeepSpeed's own weights."""

import json

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from helpers.real_checkpoints import RUNS
from safetensors.torch import load_file

from dattn_export.artifacts import CONVERT_MANIFEST
from dattn_export.checkpoints import open_checkpoint
from dattn_export.stages.convert import convert
from dattn_export.stages.verify import verify


def sources():
    """(run, folder inside it a user would convert): the step folder, the Trainer's checkpoint-N, save_model's."""
    for name, (_, run) in RUNS.items():
        if run["kind"] == "engine":
            yield name, "global_step2"
        elif run["kind"] == "trainer":
            yield from ((name, "checkpoint-2"), (name, "checkpoint-2/global_step2"))
        else:
            yield name, "."


def deepspeeds_own(source):
    """The Trainer's gathered 16-bit weights where it saved them, else DeepSpeed's zero_to_fp32 of the step."""
    if (source / "model.safetensors").is_file():
        return load_file(source / "model.safetensors")
    step = source if source.name.startswith("global_step") else source / (source / "latest").read_text().strip()
    return get_fp32_state_dict_from_zero_checkpoint(step.parent, tag=step.name)


def read_output(out):
    return {n: t for shard in sorted(out.glob("*.safetensors")) for n, t in load_file(shard).items()}


@pytest.mark.slow
@pytest.mark.parametrize("name, folder", list(sources()))
def test_converts_to_what_deepspeed_gives(real_checkpoints, tmp_path, name, folder):
    source = (real_checkpoints[name] / folder).resolve()  # a Trainer folder's training_args.bin is never unpickled
    theirs = deepspeeds_own(source)
    trained = load_file(real_checkpoints[name].with_suffix(".truth.safetensors"))  # the module's own parameters
    gathered = (source / "model.safetensors").is_file()
    convert(source, tmp_path / "out", dtype="auto" if gathered else "fp32")
    ours = read_output(tmp_path / "out")

    assert set(ours) == set(trained)  # the complete model, a tied lm_head stored once
    if "lm_head.weight" in theirs and "lm_head.weight" not in ours:
        assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])
    dropped = set(trained) - set(theirs)
    for name_, tensor in ours.items():
        expected = theirs.get(name_, trained[name_])  # zero_to_fp32 keeps frozen tensors 16-bit, as stored
        assert tensor.dtype == (expected.dtype if gathered else torch.float32), name_
        assert torch.equal(tensor, expected.to(tensor.dtype)), name_
        assert torch.equal(tensor.to(trained[name_].dtype), trained[name_]), name_  # masters round to the module
    notes = " ".join(json.loads((tmp_path / "out" / CONVERT_MANIFEST).read_text())["source"]["notes"])
    if RUNS[name][1]["stage"] == 1 and not gathered:  # ZeRO-1 records no frozen parameters: zero_to_fp32 drops them
        assert dropped == {n for n in trained if n.startswith("model.mm_vis.")}
        assert f"{len(dropped)} frozen tensor(s) restored from mp_rank_00_model_states.pt's module" in notes
    else:
        assert not dropped and "restored" not in notes
    checks = verify(tmp_path / "out", against=source)
    assert all(c.ok for c in checks), checks


@pytest.mark.slow
def test_bf16_output_of_fp32_masters_and_manifest(real_checkpoints, tmp_path):
    step = real_checkpoints["zero3-bf16-w2"] / "global_step2"
    assert open_checkpoint(step).layout == "deepspeed-zero"
    convert(step, tmp_path / "out", dtype="bf16")
    trained = load_file(real_checkpoints["zero3-bf16-w2"].with_suffix(".truth.safetensors"))
    ours = read_output(tmp_path / "out")
    assert set(ours) == set(trained) and all(torch.equal(ours[n], t) for n, t in trained.items())
    manifest = json.loads((tmp_path / "out" / CONVERT_MANIFEST).read_text())
    assert manifest["source"]["layout"] == "deepspeed-zero" and manifest["dtype"] == "bfloat16"
    q = manifest["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["dtype"] == "bfloat16" and q["shape"] == [128, 64] and q["source_dtype"] == "float32"
