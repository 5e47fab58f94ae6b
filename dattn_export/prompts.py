"""How a prompt becomes the ids the released inference scripts make: a question through the checkpoint's chat
template with the media's marker first, a retrieval query in the family's released task prompt, or a finished (raw)
prompt as it is; then tokenized as Vidi's `tokenizer_image_token` does. Light: the CLI checks prompts with it before
torch is imported."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .errors import InputError
from .modeling.families import task_macro
from .modeling.marked_prompts import MEDIA_MARKERS, media_marker

QUERY_WITHOUT_VIDEO = "asks when something happens in a video file: pass it with --video"

PROMPT_KINDS = {  # how each kind is given on the command line
    "question": "--prompt",
    "query": "--query",
    "raw": "--raw-prompt",
}


@dataclass(frozen=True)
class Prompt:
    """What is asked. A question goes through the checkpoint's chat template as the released scripts ask (the media's
    marker and a newline first, one user turn, the model's turn opened); a retrieval query ("query") is first wrapped
    in the family's released task prompt; a raw prompt is the finished text, tokenized as it is."""

    text: str
    kind: str = "question"

    def __post_init__(self):
        if self.kind != "raw" and media_marker(self.text):
            raise InputError(
                PROMPT_KINDS[self.kind],
                f"{self.text!r} holds {media_marker(self.text)}: a {self.kind} is asked through the checkpoint's chat "
                "template, which places the media's marker itself; pass a finished prompt with --raw-prompt",
            )

    def text_for(self, tokenizer, family, media: bool, length: float | None = None) -> str:
        """The prompt's text for `prompt_ids`: `media`, whether media come with it; `length`, the video's seconds
        (a query's task prompt may state them)."""
        if self.kind == "raw":
            return self.text
        if self.kind == "query" and family.released_task is None:
            raise InputError("--query", f"the {family.name} family has no released retrieval task: ask with --prompt")
        if self.kind == "query" and length is None:
            raise InputError("--query", QUERY_WITHOUT_VIDEO)
        question = self.text if self.kind == "question" else task_prompt(family, self.text, length)
        return chat_text(tokenizer, f"{MEDIA_MARKERS[0]}\n{question}" if media else question)


@cache
def task_template(task: str):
    """The chat template's task macro (`families.task_macro`) as a template of its own, in a sandbox as transformers
    renders chat templates."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(task_macro(task) + "{{- task_prompt(text) -}}")


def task_prompt(family, query: str, length: float) -> str:
    """The released inference script's question for a retrieval query about a video `length` seconds long: the
    chat template's own rule (its trailing period cut, the length's format), rendered here, so that the CLI and a Hub
    user's `apply_chat_template(..., task="retrieval")` ask alike."""
    if family.released_task is None:
        raise ValueError(f"the {family.name} family has no released task")
    return task_template(family.released_task).render(text=query, video_length=length)


def asked(question: str, tokenizer) -> Prompt:
    """A question about media as the checkpoint is asked it: through its chat template, or where it has none, as the
    released scripts' text before their template (the media's marker, a newline, the question)."""
    return Prompt(question) if tokenizer.chat_template else Prompt(f"{MEDIA_MARKERS[0]}\n{question}", "raw")


def asked_texts(questions: Iterable[str], tokenizer, family) -> list[str]:
    """Questions about media as the checkpoint is asked them (`asked`), as texts for `prompt_ids`."""
    return prompt_texts([asked(question, tokenizer) for question in questions], tokenizer, family, True, None)


def as_prompt(prompt: str | Prompt) -> Prompt:
    """A prompt given as a plain string is a finished one (raw), as it always was in the Python API."""
    return prompt if isinstance(prompt, Prompt) else Prompt(prompt, "raw")


def chat_text(tokenizer, content: str) -> str:
    """One user turn through the tokenizer's chat template, the model's turn opened, the BOS token's text removed
    (Vidi's `preprocess_chat`: `prompt_ids` tokenizes it with the BOS, as its `tokenizer_image_token` does)."""
    if not tokenizer.chat_template:
        raise InputError(
            tokenizer.name_or_path,
            "has no chat template: save the model's as chat_template.jinja beside its tokenizer, or pass a finished "
            "prompt with --raw-prompt",
        )
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text.replace(tokenizer.bos_token, "") if tokenizer.bos_token else text


def prompt_texts(prompts: list[Prompt], tokenizer, family, media: bool, length: float | None) -> list[str]:
    """Each prompt's text for `prompt_ids` (`Prompt.text_for`)."""
    return [prompt.text_for(tokenizer, family, media, length) for prompt in prompts]


def read_prompts(path: Path) -> list[Prompt]:
    """A file of questions: one a line, or JSON lines (`.jsonl`, for text with line breaks: a question as a string
    or {"prompt": ...}, a retrieval query as {"query": ...}, a finished prompt as {"raw_prompt": ...}); blank lines
    skipped."""
    prompts, keys = [], {"prompt": "question", "query": "query", "raw_prompt": "raw"}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        if Path(path).suffix != ".jsonl":
            item = line
        else:
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(path, f"line {number} is not JSON ({e.msg})") from None
        key = next((key for key in keys if key in item), None) if isinstance(item, dict) else "prompt"
        text = item.get(key) if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise InputError(path, f'line {number} is neither a string nor an object with a "prompt" string')
        if keys[key] != "raw" and (marker := media_marker(text)):
            raise InputError(path, f'line {number} holds {marker}: give a finished prompt as {{"raw_prompt": ...}}')
        prompts.append(Prompt(text, keys[key]))
    if not prompts:
        raise InputError(path, "holds no prompt")
    return prompts
