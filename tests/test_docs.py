"""The documentation: the site builds in strict mode with nothing leaked or broken, the CLI reference is the
commands' own, and every command block of getting started and of every guide runs as written, in order, on the demo
models (the blocks that need a GPU, a Hub token or start a server say so on their first line, and are not run)."""

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import click
import pytest
from helpers.guides import (
    assert_printed,
    bash_blocks,
    joined_lines,
    readme_blocks,
    run_block,
    runnable,
    runnable_with_output,
)

from dattn_export.cli import main

ROOT = Path(__file__).resolve().parent.parent
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
LEAKS = ("Sentinel", "UNSET", "--8<--", "::: mkdocs", "mkdocs-click", "{{", "{%")


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


def test_the_cli_reference_is_the_commands_own(site):
    """The committed page is what tools/cli_reference.py writes now, and it names every option of every command with
    its default, its choices, whether it is required, and the command's examples."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import cli_reference
    finally:
        sys.path.pop(0)
    committed = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert committed == cli_reference.reference(), "run: python tools/cli_reference.py > docs/reference/cli.md"
    context = click.Context(main)
    for name in main.list_commands(context):
        command = main.get_command(context, name)
        section = committed.split(f"## dattn-export {name}\n")[1].split("\n## ")[0]
        for param in command.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("-"):
                    assert f"`{opt}`" in section, f"{name} {opt}"
        for example in (line.strip() for line in command.epilog.splitlines() if line.strip().startswith("dattn-")):
            assert example in section, example
    convert = committed.split("## dattn-export convert\n")[1].split("\n## ")[0]
    assert "| `--dtype` | `auto` \\| `fp32` \\| `fp16` \\| `bf16` | `auto` |" in convert
    assert re.search(r"\| `-o`, `--output` \| `DIRECTORY` \|  \| yes \|", convert)
    page = (site / "reference" / "cli" / "index.html").read_text()
    assert "&lt;image&gt;" in page  # the prompt marker survives as text


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("href", "src") and value:
                self.links.append(value)


def test_the_site_leaks_nothing_and_links_only_to_what_exists(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    broken, leaked = [], []
    for page in pages:
        html = page.read_text()
        text = re.sub(r"<script.*?</script>|<[^>]+>", " ", html, flags=re.S)  # what a reader sees
        leaked += [(page.relative_to(site), leak) for leak in LEAKS if leak in text]
        parser = Links()
        parser.feed(html)
        for link in parser.links:
            url = urlparse(link)
            if url.scheme or url.netloc or link.startswith(("#", "mailto:", "data:")):
                continue
            base = site if url.path.startswith("/") else page.parent  # 404.html links from the site's root
            target = (base / unquote(url.path).lstrip("/")).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append((str(page.relative_to(site)), link))
    assert not leaked, leaked
    assert not broken, broken[:10]


def test_the_readme_and_the_docs_link_to_files_that_exist():
    """Relative links as GitHub renders the Markdown itself (README.md, the docs' pages)."""
    broken = []
    for page in [ROOT / "README.md", ROOT / "tools" / "gpu_check" / "README.md", *(ROOT / "docs").rglob("*.md")]:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if urlparse(link).scheme or link.startswith("#"):
                continue
            if not (page.parent / unquote(link.split("#")[0])).exists():
                broken.append((str(page.relative_to(ROOT)), link))
    assert not broken, broken


def test_the_python_api_is_documented_from_docstrings(site):
    page = (site / "reference" / "python" / "index.html").read_text()
    for name in ("checkpoints.source.load_model", "runtime.graph.GraphRuntime", "runtime.genai.GenaiRuntime"):
        assert f'id="dattn_export.{name}"' in page, name


def test_getting_started_continues_from_the_readme_quickstart():
    """Reported: getting started repeated the README's quickstart block, so a reader who ran the README first met
    "already exists" on convert and onnx. It continues from the quickstart: none of its commands is shown again."""
    quickstart = {line for line in readme_blocks()["quickstart"].splitlines() if line.strip()}
    shown = {line for block in bash_blocks(ROOT / "docs" / "getting-started.md") for line in block.splitlines()}
    assert not quickstart & shown, quickstart & shown
    assert "continues from it" in (ROOT / "docs" / "getting-started.md").read_text()


@pytest.mark.slow
def test_the_readme_and_getting_started_run_as_written_on_a_fresh_clone(pipeline):
    """The README's set-up line (a venv, the install, the demo), then its quickstart, which goes on from the demo's
    folder, then getting started's blocks: each command exits 0 (the fixture asserts it), in one fresh clone."""
    logs = pipeline / "commands"
    assert "validation passed" in (logs / "setup" / "0.out").read_text()  # the demo, at the end of the set-up line
    assert (pipeline / ".venv" / "bin" / "dattn-export").is_file()  # the set-up line's own install
    quickstart = [c for c in joined_lines(readme_blocks()["quickstart"]) if c.strip()]
    assert sorted(logs.glob("quickstart/*.out")) == [logs / "quickstart" / f"{n}.out" for n in range(len(quickstart))]
    assert (pipeline / "converted" / "dattn_manifest.json").is_file()
    assert (pipeline / "onnx" / "validation_report.json").is_file()
    pushed = (logs / "quickstart" / f"{len(quickstart) - 1}.out").read_text()  # push --dry-run
    assert "dry run:" in pushed and "would be committed to me/my-dattn" in pushed
    assert len(list(logs.glob("getting-started-*"))) == len(runnable(ROOT / "docs" / "getting-started.md")) >= 2
    assert (pipeline / "video-demo" / "onnx" / "validation_report.json").is_file()


README_FIGURES = {
    "a date": r"\b20\d\d-\d\d-\d\d\b",
    "an issue number": r"(?i)\bissues? #?\d+|#\d+\b",
    "a time measured": r"\b\d+(\.\d+)?\s?(s|ms|min|sec|seconds|minutes)\b",
    "a speed ratio": r"\b\d+\.\d+x\b",
    "a run-to-run spread": r"\b\d+(\.\d+)?\s?-\s?\d+(\.\d+)?\s?(s|ms|x|GiB|GB|%)\b",
}


@pytest.mark.parametrize("kind", list(README_FIGURES))
def test_the_readme_holds_no_dated_figure(kind):
    """The README says what the tool does, how to install and run it and what it supports; figures, with their
    commands, dates and machines, live in docs/benchmarks.md."""
    found = re.findall(README_FIGURES[kind], (ROOT / "README.md").read_text())
    assert not found, found


DEMO_FOLDERS = {"dattn-demo": "dattn-export demo", "video-demo": "dattn-export demo video-demo --input video"}


def test_every_guide_says_in_its_first_lines_what_it_starts_from():
    """Reported: guides started from folders the demo does not make (the README quickstart's `converted`, `onnx`). A
    guide whose commands read a demo's folder names it, and the command that writes it, before its first command."""
    for page in GUIDES:
        commands = "".join(bash_blocks(page))
        opening = page.read_text().split("```")[0]
        for folder, command in DEMO_FOLDERS.items():
            if f"{folder}/" in commands:
                assert f"{folder}/" in opening and command.split(" --")[0] in opening, (page.name, folder)
        assert not re.search(r"(?<![\w/.-])(converted|onnx)/", commands), page.name  # the quickstart's folders


@pytest.mark.slow
@pytest.mark.parametrize("guide", [page.stem for page in GUIDES if runnable(page)])
def test_every_guide_runs_as_written(pipeline, tmp_path, guide):
    """Each guide's blocks in order, in a folder that holds only what the README's demo command and getting started's
    video demo wrote (copied from the pipeline's), as a newcomer who ran those has it (a guide whose every block
    needs what this machine lacks, vLLM's and the GPU check's, is not listed: its blocks say what they need)."""
    work = tmp_path / "work"
    for folder in DEMO_FOLDERS:
        shutil.copytree(pipeline / folder, work / folder)
    for block, shown in runnable_with_output(ROOT / "docs" / "guides" / f"{guide}.md"):
        result = run_block(block, work)
        if shown is not None:  # what the page says the block prints
            assert_printed(shown, result.stdout)
