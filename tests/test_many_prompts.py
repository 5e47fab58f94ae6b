"""Many prompts about one picture or video (issue 49): the context encoded once, each prompt answered from it exactly
as it is answered alone."""

import json
import re

import pytest
from helpers.cli import error_line, run_cli

from dattn_export.demo_model import DEMO_PROMPT
from dattn_export.errors import InputError
from dattn_export.media import Media
from dattn_export.stages.generate import read_prompts, run_prompt, run_prompts, run_prompts_graphs

PROMPTS = [
    DEMO_PROMPT,
    "USER: <image>\nHow many objects are there, and where?\nASSISTANT:",
    "USER: Name one colour.\nASSISTANT:",
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
    """--prompt given twice and a JSON-lines file (a prompt with line breaks, as a string and as an object): the
    answers in that order, then one table with the encoding once and each answer's time."""
    demo = pipeline / "dattn-demo"
    lines = [json.dumps(PROMPTS[1]), "", json.dumps({"prompt": PROMPTS[0]})]
    (tmp_path / "questions.jsonl").write_text("\n".join(lines) + "\n")
    result = run_cli(
        "generate", demo / "onnx", "--backend", "ort", "--image", demo / "checkpoint" / "demo.png",
        "--prompt", PROMPTS[2], "--prompt", PROMPTS[0], "--prompts", tmp_path / "questions.jsonl",
        "--max-new-tokens", "8",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    printed = re.findall(r"answer \d: generated ids \(\d+\): (\[.*\])", result.stdout)
    assert [json.loads(ids) for ids in printed] == [alone[2], alone[0], alone[1], alone[0]]
    assert "time, once" in result.stdout and "answer 4: " in result.stdout
    assert len(re.findall(r"done encode", result.stderr)) == 1


def test_a_prompts_file_is_lines_or_json_lines(tmp_path):
    (tmp_path / "plain.txt").write_text("first question\n\n  second one\n")
    assert read_prompts(tmp_path / "plain.txt") == ["first question", "  second one"]
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
    assert result.returncode == 2 and "--prompt TEXT (repeatable) or --prompts FILE" in error_line(result.stderr)
