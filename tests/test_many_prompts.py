"""Many prompts about one picture or video (issue 49): the context encoded once, each prompt answered from it exactly
as it is answered alone."""

import json
import re

import pytest
from helpers.cli import error_line, run_cli

from dattn_export.demo_model import DEMO_QUESTIONS
from dattn_export.errors import InputError
from dattn_export.media_options import Media
from dattn_export.prompts import Prompt, read_prompts
from dattn_export.stages.generate import run_prompt, run_prompts, run_prompts_graphs

PROMPTS = [
    Prompt(DEMO_QUESTIONS["image"]),
    Prompt("How many objects are there, and where?"),
    Prompt("USER: Name one colour.\nASSISTANT:", "raw"),
]


@pytest.fixture(scope="module")
def alone(pipeline):
    """Each prompt answered alone by the reference, its context encoded afresh."""
    demo = pipeline / "dattn-demo"
    media = Media(images=[demo / "checkpoint" / "demo.png"])
    answers = [run_prompt(demo / "converted", prompt, media, 8).generated_ids for prompt in PROMPTS]
    assert len(set(map(tuple, answers))) == len(PROMPTS)  # different answers: one answer given to all would show
    return answers


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "ort", "genai"])
def test_each_prompt_gets_the_answer_it_gets_alone(pipeline, alone, backend):
    demo = pipeline / "dattn-demo"
    media = Media(images=[demo / "checkpoint" / "demo.png"])
    if backend == "torch":
        answers = run_prompts(demo / "converted", PROMPTS, media, 8)
    else:
        answers = run_prompts_graphs(demo / "onnx", PROMPTS, media, 8, backend)
    assert [result.generated_ids for result in answers.results] == alone
    encoded = [step for step in answers.seconds if step.startswith("encode")]
    assert len(encoded) == 1 and all(len(result.seconds) == 1 for result in answers.results)  # encoded once


@pytest.mark.slow
def test_generate_takes_prompts_repeated_and_from_a_file(pipeline, alone, tmp_path):
    """--prompt, --raw-prompt and a JSON-lines file (questions as a string and as an object): the answers in that
    order (questions, then finished prompts, then the file's), then one table with the encoding once and each
    answer's time."""
    demo = pipeline / "dattn-demo"
    lines = [json.dumps(PROMPTS[1].text), "", json.dumps({"prompt": PROMPTS[0].text})]
    (tmp_path / "questions.jsonl").write_text("\n".join(lines) + "\n")
    result = run_cli(
        "generate", demo / "onnx", "--backend", "ort", "--image", demo / "checkpoint" / "demo.png",
        "--raw-prompt", PROMPTS[2].text, "--prompt", PROMPTS[0].text, "--prompts", tmp_path / "questions.jsonl",
        "--max-new-tokens", "8",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    printed = re.findall(r"answer \d: generated ids \(\d+\): (\[.*\])", result.stdout)
    assert [json.loads(ids) for ids in printed] == [alone[0], alone[2], alone[1], alone[0]]
    assert "time, once" in result.stdout and "answer 4: " in result.stdout
    assert len(re.findall(r"done encode", result.stderr)) == 1


def test_a_prompts_file_is_lines_or_json_lines(tmp_path):
    (tmp_path / "plain.txt").write_text("first question\n\n  second one\n")
    assert read_prompts(tmp_path / "plain.txt") == [Prompt("first question"), Prompt("  second one")]
    kinds = ['"a question"', '{"query": "a door opens"}', '{"raw_prompt": "USER: <image>\\nWhat?"}']
    (tmp_path / "kinds.jsonl").write_text("\n".join(kinds))
    assert read_prompts(tmp_path / "kinds.jsonl") == [
        Prompt("a question"),
        Prompt("a door opens", "query"),
        Prompt("USER: <image>\nWhat?", "raw"),
    ]
    (tmp_path / "marked.txt").write_text("USER: <image> What?\n")
    with pytest.raises(InputError, match=r'line 1 holds <image>: give a finished prompt as \{"raw_prompt": ...\}'):
        read_prompts(tmp_path / "marked.txt")
    (tmp_path / "bad.jsonl").write_text('"fine"\n{"prompt": 3}\n')
    with pytest.raises(InputError, match=r'line 2 is neither a string nor an object with a "prompt" string'):
        read_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "cut.jsonl").write_text('"fine"\n"cut\n')
    with pytest.raises(InputError, match="line 2 is not JSON"):
        read_prompts(tmp_path / "cut.jsonl")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(InputError, match="holds no prompt"):
        read_prompts(tmp_path / "empty.txt")


def test_generate_without_a_prompt_says_how_to_give_one(tmp_path):
    result = run_cli("generate", tmp_path)
    assert (
        result.returncode == 2
        and "--prompt TEXT (repeatable), --query TEXT, --raw-prompt TEXT or --prompts FILE" in error_line(result.stderr)
    )
