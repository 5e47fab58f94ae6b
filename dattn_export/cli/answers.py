"""How an answer is printed: generate and demo (a prompt's ids, text and time ranges; the context's tokens; timings)."""

from __future__ import annotations

from pathlib import Path


def print_prompt_result(
    title: str, result, rows: list[tuple[str, str]], seconds: dict[str, float] | None = None
) -> None:
    from ..ui import out, summary_table

    print_answer(result)
    out.print(summary_table(title, [*rows, *context_rows(result), ("time", timings(seconds or result.seconds))]))


def print_answers(title: str, answers, rows: list[tuple[str, str]]) -> None:
    """Each prompt's answer, then one table: the context (encoded once) and each answer's time."""
    from ..ui import out, summary_table

    for number, result in enumerate(answers.results, 1):
        print_answer(result, f"answer {number}: ")
    once = timings(answers.seconds)
    each = "\n".join(f"answer {n}: {sum(r.seconds.values()):.2f} s" for n, r in enumerate(answers.results, 1))
    rows = [*rows, ("prompts", str(len(answers.results))), *context_rows(answers.results[0])]
    out.print(summary_table(title, [*rows, ("time, once", once), ("time, each prompt", each)]))


def answers_json(answers, prompts: list[str], checkpoint: Path, backend: str) -> dict:
    import dataclasses

    first = answers.results[0]
    return {
        "checkpoint": str(checkpoint),
        "backend": backend,
        "visual_tokens": first.visual_tokens,
        "audio_tokens": first.audio_tokens,
        "seconds": answers.seconds,
        "answers": [
            {"prompt": prompt, **{k: v for k, v in dataclasses.asdict(result).items() if k not in ANSWER_SHARED}}
            for prompt, result in zip(prompts, answers.results)
        ],
    }


ANSWER_SHARED = ("visual_tokens", "audio_tokens", "parameters")  # a PromptResult's fields that every answer shares


def print_answer(result, label: str = "") -> None:
    from ..ui import out

    out.print(f"{label}prompt ids ({len(result.prompt_ids)}): {result.prompt_ids}")
    out.print(f"{label}generated ids ({len(result.generated_ids)}): {result.generated_ids}")
    out.print(f"{label}generated text: {result.text!r}")
    if result.time_ranges is not None:  # a video file's answer, as the released inference script prints it
        out.print(f"{label}time ranges: {', '.join(result.time_ranges) or '(none in the answer)'}")


def context_rows(result) -> list[tuple[str, str]]:
    from ..checkpoints.names import AUDIO_TOWER_NOT_RUN

    rows = [("parameters", ", ".join(f"{k} {v:,}" for k, v in result.parameters.items()))]
    rows.append(("visual tokens", str(result.visual_tokens)))
    if result.audio_tokens is not None:
        rows.append(("audio tokens", str(result.audio_tokens)))
    elif "audio tower" in result.parameters:
        rows.append(("audio tower", AUDIO_TOWER_NOT_RUN))
    return rows


def timings(seconds: dict[str, float]) -> str:
    return "\n".join(f"{k.split(':')[0]}: {v:.2f} s" for k, v in seconds.items())
