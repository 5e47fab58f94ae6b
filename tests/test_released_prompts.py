"""Prompts asked as the released models were trained to be asked, held to Vidi's own inference scripts: the text and
ids that its `preprocess_chat` + `tokenizer_image_token` made, around its scripts' own task template, for a question
and two retrieval queries about the demo video, on the demo tokenizer with the family's chat template
(tools/vidi_oracle/prompt_oracle.py under the released transformers; recorded in fixtures/released_prompts)."""

import json
import shutil
from pathlib import Path

import pytest
from helpers.cli import run_cli

from dattn_export.demo_model import write_demo_checkpoint
from dattn_export.modeling.families import FAMILIES
from dattn_export.modeling.marked_prompts import prompt_ids
from dattn_export.modeling.media_files import media_duration
from dattn_export.processing import load_tokenizer
from dattn_export.prompts import Prompt

FIXTURES = Path(__file__).parent / "fixtures" / "released_prompts"
IMAGE_TOKEN_INDEX = -200  # the released code's stand-in for the media in the ids; D-Attn keeps the media out of them


def oracle(family: str) -> dict:
    return json.loads((FIXTURES / family / "oracle.json").read_text())


def released_ids(case: dict) -> list[int]:
    return [i for i in case["input_ids"] if i != IMAGE_TOKEN_INDEX]


def test_prompts_are_the_released_scripts(family):
    """Each prompt's text is the released `preprocess_chat`'s (the chat template, the BOS text removed; the task
    template and its trailing-period rule for a query), and its ids are `tokenizer_image_token`'s."""
    record = oracle(family)
    tokenizer = load_tokenizer(FIXTURES / family, None)
    assert {case["kind"] for case in record["cases"]} == {"question", "query"}
    for case in record["cases"]:
        prompt = Prompt(case["text"], case["kind"])
        text = prompt.text_for(tokenizer, FAMILIES[family], media=True, length=record["length"])
        assert text == case["prompt"]
        assert prompt_ids(tokenizer, text) == released_ids(case)


def test_the_chat_template_asks_the_retrieval_task_as_the_released_scripts(family):
    """The family's chat template with `task="retrieval"` (and the video's length, where the task states it) puts a
    user's query in the released task prompt: what a plain chat client asks a served model with (vLLM's
    `chat_template_kwargs`), the released script's text for every case of the oracle's."""
    record = oracle(family)
    tokenizer = load_tokenizer(FIXTURES / family, None)
    for case in record["cases"]:
        if case["kind"] != "query":
            continue
        for content in (f"<image>\n{case['text']}", [{"type": "video"}, {"type": "text", "text": case["text"]}]):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True,
                task="retrieval", video_length=record["length"],
            )  # fmt: skip
            assert text.replace(tokenizer.bos_token, "") == case["prompt"]
    if family == "mistral":  # its task prompt states the video's length
        with pytest.raises(Exception, match="pass video_length"):
            tokenizer.apply_chat_template([{"role": "user", "content": "a dog"}], tokenize=False, task="retrieval")


def video_checkpoint(tmp_path: Path, family: str) -> Path:
    """The demo video model with the oracle's tokenizer files (the demo writes the same ones: held here too)."""
    folder = write_demo_checkpoint(tmp_path / "video", family, video=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_text() == (FIXTURES / family / name).read_text()
        shutil.copy(FIXTURES / family / name, folder / name)
    return folder


def asked(folder: Path, video: Path, record: dict, *options) -> list[dict]:
    """generate's answers to the oracle's cases about the video, asked with --prompt and --query."""
    asked = [("--prompt" if case["kind"] == "question" else "--query", case["text"]) for case in record["cases"]]
    args = [option for pair in asked for option in pair]
    result = run_cli("generate", folder, *args, "--video", video, "--max-new-tokens", "2", "--json", *options)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["answers"]


def test_generate_asks_about_a_video_file_as_the_released_scripts(tmp_path, family):
    """`generate --prompt` and `--query` about a real video file: the released scripts' ids, the video's length read
    from the file as their ffprobe reads it."""
    record = oracle(family)
    folder = video_checkpoint(tmp_path, family)
    assert media_duration(folder / "demo.mov") == record["length"]
    answers = asked(folder, folder / "demo.mov", record)
    assert [answer["prompt_ids"] for answer in answers] == [released_ids(case) for case in record["cases"]]


@pytest.mark.slow
def test_every_backend_asks_with_the_released_ids(tmp_path, family):
    """The same ids from the exported graphs on ONNX Runtime and from onnxruntime-genai, and answers equal to the
    reference's."""
    record = oracle(family)
    folder = video_checkpoint(tmp_path, family)
    assert run_cli("onnx", folder, "-o", tmp_path / "onnx").returncode == 0
    reference = asked(folder, folder / "demo.mov", record)
    assert [answer["prompt_ids"] for answer in reference] == [released_ids(case) for case in record["cases"]]
    for backend in ("ort", "genai"):
        answers = asked(tmp_path / "onnx", folder / "demo.mov", record, "--backend", backend)
        for key in ("prompt_ids", "generated_ids", "time_ranges"):
            assert [a[key] for a in answers] == [a[key] for a in reference], (backend, key)


def test_a_question_with_a_marker_names_the_raw_form(tmp_path):
    """A prompt finished by hand (an old script's) given as a question: one line naming --raw-prompt, before any
    model work; the raw form gives the ids of the text as it is."""
    folder = write_demo_checkpoint(tmp_path / "demo")
    finished = "USER: <image>\nWhat is it?\nASSISTANT:"
    refused = run_cli("generate", folder, "--prompt", finished, "--image", folder / "demo.png")
    assert refused.returncode == 2 and "--raw-prompt" in refused.stderr and len(refused.stderr.splitlines()) == 1
    raw = run_cli("generate", folder, "--raw-prompt", finished, "--image", folder / "demo.png", "--json")
    assert raw.returncode == 0, raw.stderr
    tokenizer = load_tokenizer(folder, None)
    before, after = finished.split("<image>")
    expected = tokenizer(before)["input_ids"] + tokenizer(after, add_special_tokens=False)["input_ids"]
    assert json.loads(raw.stdout)["answers"][0]["prompt_ids"] == expected


def test_a_checkpoint_without_a_chat_template_says_how_to_ask(tmp_path):
    folder = write_demo_checkpoint(tmp_path / "demo")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    result = run_cli("generate", folder, "--prompt", "What is it?", "--image", folder / "demo.png")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "has no chat template" in result.stderr and "chat_template.jinja" in result.stderr
    assert "--raw-prompt" in result.stderr


def test_query_needs_a_video_file_and_a_released_task(tmp_path):
    folder = write_demo_checkpoint(tmp_path / "demo")
    result = run_cli("generate", folder, "--query", "a door opens")
    assert result.returncode == 2 and "--query" in result.stderr and "--video" in result.stderr
    qwen = write_demo_checkpoint(tmp_path / "qwen", "qwen2", video=True)
    result = run_cli("generate", qwen, "--query", "a door opens", "--video", qwen / "demo.mov")
    assert result.returncode == 2 and "no released retrieval task" in result.stderr


def test_verify_holds_a_converted_folder_to_its_source_s_chat_template(tmp_path):
    """verify's chat template check: the source's template, rendering a question with its media; one that drops the
    media's marker, or another than the source's, fails by name."""
    from dattn_export.checkpoints.source import open_source
    from dattn_export.stages.convert import convert
    from dattn_export.stages.verify import check_chat_template

    source = write_demo_checkpoint(tmp_path / "demo")
    convert(source, tmp_path / "converted")
    check = check_chat_template(tmp_path / "converted", open_source(source))
    assert check.ok and check.detail == "chat template the source's, asking with the media first", check
    path = tmp_path / "converted" / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for template, finding in [
        (
            "{{ messages[0]['content'] | replace('<image>', '') }}",
            "chat template drops the media's marker from a question",
        ),
        ("{{ bos_token }}{{ messages[0]['content'] }}", "chat template differs from the source's"),
    ]:
        path.write_text(json.dumps(config | {"chat_template": template}))
        check = check_chat_template(tmp_path / "converted", open_source(source))
        assert not check.ok and check.detail == finding, check
