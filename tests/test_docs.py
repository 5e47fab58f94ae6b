"""The documentation: the site builds in strict mode, its CLI reference lists every option of every command, and
the README's quickstart runs verbatim."""

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from dattn_export.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    return out


def test_the_cli_reference_lists_every_option_of_every_command(site):
    page = (site / "reference" / "cli" / "index.html").read_text()
    context = click.Context(main)
    for name in main.list_commands(context):
        command = main.get_command(context, name)
        assert f"dattn-export {name}" in page, name
        for param in command.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("-"):
                    assert opt in page, f"{name} {opt}"


def test_the_python_api_is_documented_from_docstrings(site):
    page = (site / "reference" / "python" / "index.html").read_text()
    for name in ("checkpoints.source.load_model", "runtime.graph.GraphRuntime", "runtime.genai.GenaiRuntime"):
        assert f'id="dattn_export.{name}"' in page, name


@pytest.mark.slow
def test_the_readme_quickstart_runs_verbatim(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("[start:quickstart]")[1].split("[end:quickstart]")[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "converted" / "dattn_manifest.json").is_file()
    assert (tmp_path / "onnx" / "validation_report.json").is_file()
    assert "dry run:" in result.stdout and "would be committed to me/my-dattn" in result.stdout
