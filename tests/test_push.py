"""push: the real huggingface_hub client over HTTP against a Hub-compatible server on loopback."""

import hashlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.hub_server import client_env as hub_env
from helpers.hub_server import start
from huggingface_hub import ModelCard
from PIL import Image

from dattn_export.checkpoints.source import load_model
from dattn_export.demo_model import DEMO_QUESTIONS, write_demo_checkpoint
from dattn_export.stages.convert import convert

TOKEN = "hf_alice_secret_token_42"
TOKENS = {TOKEN: "alice", "hf_bob_token": "bob"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("push")
    checkpoint = write_demo_checkpoint(root / "checkpoint", "gemma2")
    convert(checkpoint, root / "converted")
    return root / "converted"


@pytest.fixture
def hub():
    server, state, endpoint = start(TOKENS)
    yield state, endpoint
    server.shutdown()


def push_cli(tmp_path, endpoint, *args, token=TOKEN):
    result = subprocess.run(
        [sys.executable, "-m", "dattn_export", "push", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=hub_env(tmp_path, endpoint, token),
    )
    assert TOKEN not in result.stdout + result.stderr, "the token was printed"
    return result


def commits_on(state, repo_id):
    repo = state.repos.get(repo_id)
    return [] if repo is None else [c for c in repo.commits.values() if c["files"]]


FRESH_PROCESS = textwrap.dedent("""
    import sys
    sys.modules["dattn_export"] = None  # this process must not be able to use the package
    import numpy as np, torch
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM

    repo_id, out = sys.argv[1], sys.argv[2]
    folder = snapshot_download(repo_id)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 7), generator=g)
    pixels = torch.randn(2, 1, 3, 32, 32, generator=g)
    with torch.no_grad():
        np.save(out, model(ids, pixels).logits.numpy())
    readme = open(folder + "/README.md").read()
    snippet = readme.split("```python")[1].split("```")[0]
    exec(snippet.replace("picture.jpg", sys.argv[3]))  # the model card's usage, as written: a wide RGBA picture

    # the processor's pixels are the released ones under every rule (the helper imports no dattn_export)
    sys.path.insert(0, sys.argv[4])
    from released_images import open_picture, process_images, with_output_size
    from types import SimpleNamespace
    from PIL import Image
    image, released = Image.open(sys.argv[3]).convert("RGB"), with_output_size(processor.image_processor)
    side, points = released.output_size, [[1, 2], [2, 1], [2, 2]]
    for rule in ("resize", "pad", "crop", "anyres"):
        for config in (model.config, processor.model_config):
            config.mm_image_aspect_ratio, config.mm_image_grid_points = rule, points
        cfg = SimpleNamespace(mm_image_aspect_ratio=rule, mm_image_grid_res=[[c * side, r * side] for c, r in points])
        pixels = process_images([open_picture(sys.argv[3])], released, cfg)
        with torch.no_grad():
            inputs = processor(text="<image>", images=image, return_tensors="pt")
            got, _ = model.model.encode_inputs(**{k: v for k, v in inputs.items() if k.startswith(("pixel", "image"))})
            if rule == "anyres":
                expected, _ = model.model.encode_anyres([pixels[0]], [image.size])
            else:
                expected, _ = model.model.encode_images(pixels[None])
        assert all(torch.equal(a, b) for x, y in zip(got, expected) for a, b in zip(x, y)), rule
    print("the usage's pixels are the released ones under every rule")
""")


@pytest.mark.slow  # 16 s; the fast tier pushes (dry run, auth errors, the card) without loading the repo back
def test_push_then_load_with_transformers_in_a_fresh_process(converted, hub, tmp_path):
    state, endpoint = hub
    result = push_cli(
        tmp_path,
        endpoint,
        converted,
        "--repo-id",
        "alice/tiny-dattn",
        "--license",
        "apache-2.0",
        "--base-model",
        "google/gemma-2-2b",
    )
    assert result.returncode == 0, result.stderr
    (commit,) = commits_on(state, "alice/tiny-dattn")  # one commit holds everything
    files = commit["files"]
    for name in (
        "config.json",
        "modeling_dattn.py",
        "configuration_dattn.py",
        "attention.py",
        "tokenizer.json",
        "preprocessor_config.json",
        "model.safetensors",
        "dattn_manifest.json",
        "README.md",
    ):
        assert name in files, name
    assert files["model.safetensors"][1] is True  # uploaded through LFS
    assert (
        json.loads(files["config.json"][0])["auto_map"]["AutoModelForCausalLM"]
        == "modeling_dattn.DAttnGemma2ForCausalLM"
    )
    assert TOKEN.encode() not in b"".join(data for data, _ in files.values()), "the token was uploaded"
    # no path of this machine leaves it: the checkpoint, its tower folders and the converted folder all live under
    # the fixture's folder; the manifest lists the bytes published (config.json's towers as no local folder)
    machine = str(converted.parent).encode()
    assert machine in (converted / "config.json").read_bytes()  # the local config names the tower folders
    assert [name for name, (data, _) in files.items() if machine in data] == []
    published = json.loads(files["config.json"][0])
    assert (
        published["mm_vision_tower"] is None
        and published["vision_config"] == load_model(converted).config.vision_config
    )
    listed = json.loads(files["dattn_manifest.json"][0])["files"]
    assert {name: hashlib.sha256(files[name][0]).hexdigest() for name in listed} == {
        name: entry["sha256"] for name, entry in listed.items()
    }

    script = tmp_path / "fresh.py"
    script.write_text(FRESH_PROCESS)
    rgba = np.random.default_rng(0).integers(0, 256, (64, 80, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "wide.png")
    env = hub_env(tmp_path, endpoint, token=None)
    helpers = Path(__file__).parent / "helpers"
    run = subprocess.run(
        [sys.executable, str(script), "alice/tiny-dattn", str(tmp_path / "logits.npy"), tmp_path / "wide.png", helpers],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the usage's pixels are the released ones under every rule" in run.stdout
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 7), generator=g)
    pixels = torch.randn(2, 1, 3, 32, 32, generator=g)
    with torch.no_grad():
        expected = load_model(converted)(ids, pixels).logits.numpy()
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), expected, atol=1e-5, rtol=0)

    card = ModelCard(files["README.md"][0].decode())
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "image-text-to-text"
    assert card.data.license == "apache-2.0" and card.data.base_model == "google/gemma-2-2b"
    assert {"dattn", "custom_code"} <= set(card.data.tags)
    assert (
        "| tensors reload | ok |" in card.text
        and "trust_remote_code=True" in card.text
        and json.dumps(DEMO_QUESTIONS["image"]) in card.text  # asked through the chat template, as the released way
        and "AutoProcessor.from_pretrained(repo, trust_remote_code=True)" in card.text
    )


def test_dry_run_lists_everything_and_contacts_nothing(converted, tmp_path):
    result = push_cli(tmp_path, "http://127.0.0.1:9", converted, "--repo-id", "alice/x", "--dry-run")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((converted / "dattn_manifest.json").read_text())
    rewritten = ["config.json", "dattn_manifest.json"]  # the local config names the tower folders
    assert f"{', '.join(rewritten)}: published without this machine's paths" in result.stdout
    for name, entry in manifest["files"].items():
        listed = re.search(rf"^{entry['sha256']}\s+{entry['size']:,}\s+{re.escape(name)}$", result.stdout, re.M)
        assert bool(listed) == (name not in rewritten) and re.search(rf"\s{re.escape(name)}$", result.stdout, re.M)
    assert "library_name: transformers" in result.stdout and "README.md" in result.stdout


@pytest.mark.slow
def test_transient_5xx_is_retried(converted, hub, tmp_path):
    state, endpoint = hub
    state.fail("POST", r"/commit/", 500, times=2)
    state.fail("POST", r"/preupload/", 503, times=1)
    result = push_cli(tmp_path, endpoint, converted, "--repo-id", "alice/retry")
    assert result.returncode == 0, result.stderr
    assert len(commits_on(state, "alice/retry")) == 1
    assert [s for m, p, s in state.log if "/commit/" in p] == [500, 500, 200]


@pytest.mark.slow
def test_persistent_5xx_publishes_nothing(converted, hub, tmp_path):
    state, endpoint = hub
    state.fail("POST", r"/commit/", 502, times=-1)
    result = push_cli(tmp_path, endpoint, converted, "--repo-id", "alice/down")
    assert result.returncode == 3  # the Hub's failure, not the input's
    (line,) = result.stderr.strip().splitlines()
    assert "answered 502 (server error) 4 times: nothing was published" in line and "alice/down" in line
    assert commits_on(state, "alice/down") == []


@pytest.mark.slow
def test_connection_dropped_mid_upload(converted, hub, tmp_path):
    state, endpoint = hub
    state.fail("PUT", r"/lfs-upload/", "drop", times=1)
    result = push_cli(tmp_path, endpoint, converted, "--repo-id", "alice/flaky")
    assert result.returncode == 0, result.stderr
    (commit,) = commits_on(state, "alice/flaky")  # no partial commit: the only one has every file
    assert {"model.safetensors", "config.json", "README.md"} <= set(commit["files"])


@pytest.mark.parametrize(
    "repo_id, token, expected",
    [
        ("alice/nope", "hf_wrong_token", "401 authentication failed"),
        ("bob/theirs", TOKEN, "403 forbidden"),
    ],
)
def test_auth_errors(converted, hub, tmp_path, repo_id, token, expected):
    state, endpoint = hub
    state.repos.clear()
    result = push_cli(tmp_path, endpoint, converted, "--repo-id", repo_id, token=token)
    assert result.returncode == 2, result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert expected in line and repo_id in line and "hf_wrong_token" not in line
    assert all(not commits_on(state, r) for r in state.repos)


def test_refuses_a_folder_that_does_not_verify(converted, hub, tmp_path):
    import shutil

    state, endpoint = hub
    folder = tmp_path / "tampered"
    shutil.copytree(converted, folder)
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text() + " ")
    result = push_cli(tmp_path, endpoint, folder, "--repo-id", "alice/t")
    assert result.returncode == 2 and "does not verify" in result.stderr and "tokenizer.json" in result.stderr
    assert "alice/t" not in state.repos
    assert push_cli(tmp_path, endpoint, folder, "--repo-id", "alice/t", "--skip-verify").returncode == 0


@pytest.mark.slow
def test_rate_limit_is_retried(converted, hub, tmp_path):
    state, endpoint = hub
    state.fail("POST", r"/preupload/", 429, times=2)
    result = push_cli(tmp_path, endpoint, converted, "--repo-id", "alice/busy")
    assert result.returncode == 0, result.stderr
    assert [s for m, p, s in state.log if "/preupload/" in p][:3] == [429, 429, 200]
    assert len(commits_on(state, "alice/busy")) == 1


@pytest.mark.slow
def test_network_down(converted, tmp_path):
    result = push_cli(tmp_path, "http://127.0.0.1:9", converted, "--repo-id", "alice/offline")  # nothing listens
    assert result.returncode == 3  # the network's failure, not the input's
    (line,) = result.stderr.strip().splitlines()
    assert "network error after 4 attempts" in line and "nothing was published" in line and "alice/offline" in line


def test_card_describes_the_attention_mode(tmp_path):
    from helpers.builders import build_model, checkpoint_of

    from dattn_export.stages.push import model_card

    cases = [
        ("mmca", {"dattn_mode": "mmca"}, "full attention within each image", "multi-modal causal attention"),
        ("dattn", {}, "diagonal V2V", "alpha merge: one softmax over [visual ; text] |"),
        (
            "wings",
            {"wings_rank": 4, "wings_layers": [1]},
            "diagonal V2V",
            "alpha merge: one softmax over [visual ; text]; WINGS visual and text learners (rank 4) with a router in "
            "layers [1] |",
        ),
    ]
    for name, overrides, visual, text in cases:
        convert(checkpoint_of(build_model("mistral", **overrides), tmp_path / name), tmp_path / f"{name}-out")
        card = model_card(tmp_path / f"{name}-out", f"alice/{name}", None, "other", None)
        assert f"| visual stream | {visual}" in card and f"| text attention | {text}" in card, card
        assert ("WINGS learners" in card) == ("wings_rank" in overrides)


def test_validation_report_goes_into_the_card(converted, tmp_path):
    """push --validation-report: an ONNX export's validation_report.json becomes the card's ONNX validation table."""
    from dattn_export.stages.validate import Comparison, ValidationReport

    report = ValidationReport(
        "onnx",
        "ckpt",
        "ort",
        "float32",
        1e-4,
        13,
        16,
        [Comparison("decoder", "logits (prefill)", 3.1e-06, 7.5e-07)],
        [5, 7, 9],
        [5, 7, 9],
    )
    path = tmp_path / "validation_report.json"
    path.write_text(json.dumps(report.to_json()))
    result = push_cli(
        tmp_path, "http://127.0.0.1:9", converted, "--repo-id", "alice/x", "--dry-run", "--validation-report", path
    )
    assert result.returncode == 0, result.stderr
    assert "## ONNX validation" in result.stdout and "greedy tokens 3/3 agree" in result.stdout
    assert "| decoder | logits (prefill) | 3.10e-06 |" in result.stdout
    path.write_text("{}")
    result = push_cli(
        tmp_path, "http://127.0.0.1:9", converted, "--repo-id", "alice/x", "--dry-run", "--validation-report", path
    )
    assert result.returncode == 2 and "not a readable validation_report.json" in result.stderr


def test_tower_folders_are_published_as_their_hub_ids(tmp_path):
    """A tower folder saved from the Hub is published as its Hub id: the vision tower's by its config's
    `_name_or_path`, the audio tower's by its place in the Hub cache; nothing names this machine's folders."""
    import shutil

    from dattn_export.stages.push import push

    checkpoint = write_demo_checkpoint(tmp_path / "checkpoint", "gemma2")
    towers = tmp_path / "towers"
    vision_config = towers / "tiny-siglip" / "config.json"
    vision_config.write_text(json.dumps(json.loads(vision_config.read_text()) | {"_name_or_path": "google/tiny-sig"}))
    cached = tmp_path / "hub" / "models--openai--whisper-tiny" / "snapshots" / "0123abc"
    shutil.move(towers / "tiny-whisper", cached)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"mm_audio_tower": str(cached)}))
    convert(checkpoint, tmp_path / "converted")
    result = push(tmp_path / "converted", "alice/tiny", dry_run=True)
    published = {f.path_in_repo: f.content if f.content is not None else f.local.read_bytes() for f in result.files}
    fields = json.loads(published["config.json"])
    assert (fields["mm_vision_tower"], fields["mm_audio_tower"]) == ("google/tiny-sig", "openai/whisper-tiny")
    assert "| vision tower | google/tiny-sig: siglip_vision_model" in published["README.md"].decode()
    assert [name for name, data in published.items() if str(tmp_path).encode() in data] == []
