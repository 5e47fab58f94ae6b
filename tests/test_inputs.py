"""What a command is given: a missing path answers before any heavy import, a folder of the wrong kind names the
command that takes it (or the one that makes the right one), and a Hub id `NS/NAME[@REVISION]` is downloaded
through huggingface_hub from a Hub-compatible server on loopback."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.hub_server import client_env, publish_folder, start
from safetensors import safe_open

from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.folders import CONVERT_MANIFEST, ONNX_MANIFEST, TRT_MANIFEST
from dattn_export.stages.convert import convert

TOKEN = "hf_carol_private_token_77"

NO_HEAVY_IMPORT = """
import sys
from dattn_export.cli import main
code = main(sys.argv[1:], standalone_mode=False)
heavy = sorted(m for m in ("torch", "transformers", "numpy", "onnx", "huggingface_hub") if m in sys.modules)
print("imported:", heavy, "code:", code)
"""


@pytest.mark.parametrize(
    "args",
    [
        ["info", "/no/such/checkpoint"],
        ["convert", "/no/such/checkpoint", "-o", "/tmp/never"],
        ["verify", "/no/such/converted"],
        ["onnx", "./no-such-checkpoint", "-o", "/tmp/never"],
        ["generate", "/no/such/checkpoint", "--prompt", "hi"],
        ["validate", "/no/such/onnx"],
        ["trt", "/no/such/onnx", "-o", "/tmp/never"],
        ["analyze", "/no/such/checkpoint", "--prompt", "hi", "-o", "/tmp/never"],
        ["serve", "/no/such/converted"],
        ["push", "/no/such/converted", "--repo-id", "a/b", "--dry-run"],
    ],
    ids=lambda args: args[0],
)
def test_a_missing_path_fails_before_any_heavy_import(args):
    result = subprocess.run([sys.executable, "-c", NO_HEAVY_IMPORT, *args], capture_output=True, text=True, timeout=60)
    assert f"Error: {args[1]}: does not exist" in result.stderr
    assert "imported: [] code: 2" in result.stdout, result.stdout + result.stderr


def marked(root: Path, name: str, manifest: str | None) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    if manifest:
        (folder / manifest).write_text("{}")
    return folder


@pytest.mark.parametrize(
    "command, given, expected",
    [
        (["convert", "{onnx}", "-o", "{root}/out"], "onnx", "is an ONNX export (for `validate`, `trt` and `generate"),
        (["generate", "{onnx}", "--prompt", "hi"], "onnx", "`generate --backend torch` takes training output"),
        (["info", "{engines}"], "engines", "is a TensorRT engines folder (for `validate --backend trt` and `generate"),
        (["verify", "{checkpoint}"], "checkpoint", "first run `dattn-export convert {checkpoint} -o CONVERTED`"),
        (["serve", "{checkpoint}"], "checkpoint", "not a converted folder: first run `dattn-export convert"),
        (["push", "{onnx}", "--repo-id", "a/b"], "onnx", "`push` takes a converted folder"),
        (["validate", "{converted}"], "converted", "first run `dattn-export onnx {converted} -o ONNX`"),
        (
            ["validate", "{checkpoint}", "--backend", "trt"],
            "checkpoint",
            "first run `dattn-export onnx {checkpoint} -o ONNX`, then `dattn-export trt ONNX -o ENGINES`",
        ),
        (["validate", "{onnx}", "--backend", "trt"], "onnx", "first run `dattn-export trt {onnx} -o ENGINES`"),
        (["trt", "{converted}", "-o", "{root}/e"], "converted", "first run `dattn-export onnx {converted} -o ONNX`"),
        (["generate", "{converted}", "--backend", "genai", "--prompt", "hi"], "converted", "first run `dattn-export"),
    ],
)
def test_a_folder_of_the_wrong_kind_names_the_next_step(tmp_path, command, given, expected):
    folders = {
        "root": tmp_path,
        "checkpoint": marked(tmp_path, "checkpoint", None),
        "converted": marked(tmp_path, "converted", CONVERT_MANIFEST),
        "onnx": marked(tmp_path, "onnx", ONNX_MANIFEST),
        "engines": marked(tmp_path, "engines", TRT_MANIFEST),
    }
    args = [arg.format(**folders) for arg in command]
    result = subprocess.run([sys.executable, "-c", NO_HEAVY_IMPORT, *args], capture_output=True, text=True, timeout=60)
    line = result.stderr.strip()
    assert line.startswith(f"Error: {folders[given]}: ") and "\n" not in line, line
    assert expected.format(**folders) in line
    assert "imported: [] code: 2" in result.stdout, result.stdout + result.stderr


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-ids")
    return convert(write_demo_checkpoint(root / "checkpoint", "mistral"), root / "converted").out


@pytest.fixture
def hub(converted):
    server, state, endpoint = start({TOKEN: "carol"})
    commit = publish_folder(state, "carol/tiny-dattn", converted)
    publish_folder(state, "carol/secret-dattn", converted, private=True)
    yield state, endpoint, commit
    server.shutdown()


def cli(tmp_path, endpoint, *args, token=TOKEN, offline=False):
    env = client_env(tmp_path, endpoint, token)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "dattn_export", *map(str, args)], capture_output=True, text=True, timeout=300, env=env
    )
    assert TOKEN not in result.stdout + result.stderr, "the token was printed"
    return result


def tensor_digests(folder: Path) -> dict[str, str]:
    digests = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                digests[name] = hashlib.sha256(f.get_tensor(name).numpy().tobytes()).hexdigest()
    return digests


@pytest.mark.slow  # the real Hub client over HTTP, with its retries' backoff
def test_hub_ids_are_read_like_local_folders(hub, converted, tmp_path):
    state, endpoint, commit = hub
    local = cli(tmp_path, endpoint, "info", converted, "--json")
    assert local.returncode == 0, local.stderr
    for given in ("carol/tiny-dattn", f"carol/tiny-dattn@{commit}", "carol/tiny-dattn@main", "carol/secret-dattn"):
        remote = cli(tmp_path, endpoint, "info", given, "--json")
        assert remote.returncode == 0, remote.stderr
        assert json.loads(remote.stdout)["parameters"] == json.loads(local.stdout)["parameters"], given

    out = tmp_path / "from-hub"
    result = cli(tmp_path, endpoint, "convert", "carol/secret-dattn", "-o", out)
    assert result.returncode == 0, result.stderr
    assert tensor_digests(out) == tensor_digests(converted)
    assert cli(tmp_path, endpoint, "verify", "carol/tiny-dattn").returncode == 0

    # the cache answers offline; what it does not hold is one line, the environment's (exit 3)
    offline = cli(tmp_path, endpoint, "info", "carol/tiny-dattn", "--json", offline=True)
    assert offline.returncode == 0, offline.stderr
    uncached = cli(tmp_path / "elsewhere", endpoint, "info", "carol/tiny-dattn", offline=True)
    assert uncached.returncode == 3 and "not in the local cache, and HF_HUB_OFFLINE=1 is set" in uncached.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "given, token, code, expected",
    [
        ("carol/secret-dattn", None, 2, "is neither a local path nor a Hub repo this token can read"),
        ("carol/no-such-model", TOKEN, 2, "is neither a local path nor a Hub repo this token can read"),
        ("carol/tiny-dattn@no-such-branch", TOKEN, 2, "has no revision 'no-such-branch'"),
    ],
)
def test_hub_ids_that_cannot_be_read_give_one_line(hub, tmp_path, given, token, code, expected):
    _, endpoint, _ = hub
    result = cli(tmp_path, endpoint, "info", given, token=token)
    line = result.stderr.strip()
    assert result.returncode == code and line.startswith(f"Error: {given}: ") and "\n" not in line, line
    assert expected in line


@pytest.mark.slow  # the real Hub client over HTTP, with its retries' backoff
def test_a_hub_that_keeps_failing_is_the_environments_problem(hub, tmp_path):
    state, endpoint, _ = hub
    state.fail("GET", r"/api/models/carol/tiny-dattn/revision/", 503, times=-1)
    result = cli(tmp_path, endpoint, "convert", "carol/tiny-dattn", "-o", tmp_path / "never")
    assert result.returncode == 3, result.stderr
    assert "the Hub answered 503 (server error) 4 times: nothing was downloaded" in result.stderr
    assert not (tmp_path / "never").exists()
