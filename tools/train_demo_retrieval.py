"""Train the demo's video model (demo_retrieval.py), a tiny D-Attn video model of a released family, on the synthetic
retrieval benchmark (demo_corpus.py), and score it on the held-out split through the product's own path (`retrieve`,
then `score`) beside the same model untrained. Seeded (the weights, the order of clips; the bits depend on torch's
threads too); says whether the weights are the bytes the package ships (demo_weights/: the defaults' run).

    python tools/train_demo_retrieval.py mistral OUT [--steps 8000] [--lr 1e-3] [--clips N] [--held-out 20]
        [--init WEIGHTS --first-clip N] [--ground 1] [--recall 1]

--init continues from a trained model's weights (a run's {family}.safetensors), with a schedule of its own, on the
train clips from --first-clip on (a run of N steps saw clips 0 to N-1). --ground and --recall weigh the losses that
teach the model which event a query means (`BindingLosses`; docs/benchmarks.md, "supervising the binding"); 0 turns
one off.

OUT gets: corpus/ (held-out.json, videos/), {family}.safetensors (the trained weights), untrained/ and trained/
(converted folders), their predictions (*.jsonl) and scores (*.score.json)."""

from __future__ import annotations

import argparse
import filecmp
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from dattn_export.checkpoints.source import load_model, saved_state_dict
from dattn_export.demo_corpus import COLOURS, SHAPES, SOUNDS, SPLITS, answer, write_benchmark, written_clip
from dattn_export.demo_model import supervised_batch
from dattn_export.demo_retrieval import ANSWER_TOKENS, HELD_OUT_CLIPS, trained_weights, write_retrieval_checkpoint
from dattn_export.modeling import attention
from dattn_export.modeling.marked_prompts import prompt_ids
from dattn_export.modeling.processing_dattn import DAttnProcessor
from dattn_export.modeling.streams import AUDIO, FRAMES
from dattn_export.prompts import Prompt
from dattn_export.stages.convert import convert

METRICS = ("precision", "recall", "iou")  # VUE-TR's areas under the curves
WORDS = (tuple(COLOURS), SHAPES, tuple(SOUNDS))  # what a query may name: a colour, a shape, a sound
UNANSWERED = 3  # the answer's first tokens ("0", ".", its first digit): predicted before any digit of it is written


def example(seed: int, scratch: Path, processor, family) -> tuple[dict, list[tuple[list[int], list[int]]], list[dict]]:
    """Train clip `seed`, written to `scratch` and read back as `retrieve` reads a video: its processor inputs, its
    queries as (prompt ids, answer ids + EOS), asked as `retrieve` asks, and the queries themselves."""
    tokenizer, queries = processor.tokenizer, written_clip(seed, scratch)
    video = scratch / f"{queries[0]['video_id']}.mov"
    media = processor(text="<image>", videos=str(video), return_tensors="pt")
    video.unlink()
    rows = []
    for q in queries:
        text = Prompt(q["query"], "query").text_for(tokenizer, family, True, q["duration"])
        reply = tokenizer(answer(q["gt"], q["duration"]), add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids(tokenizer, text), reply + [tokenizer.eos_token_id]))
    return {k: v for k, v in media.items() if k not in ("input_ids", "attention_mask")}, rows, queries


def key_seconds(segments: Tensor, frames: int, seconds: float) -> Tensor:
    """The second each context key shows (V,): a frame's tokens are its second's (one frame a second, frame-major), a
    sound token the second its middle falls in; -1 for no key."""
    out = torch.full(segments.shape[-1:], -1, dtype=torch.long)
    frame_keys, sound_keys = (torch.nonzero(segments[0] == s.segment)[:, 0] for s in (FRAMES, AUDIO))
    out[frame_keys] = torch.arange(len(frame_keys)) // max(1, len(frame_keys) // frames)
    out[sound_keys] = ((torch.arange(len(sound_keys)) + 0.5) * seconds / len(sound_keys)).long()
    return out


class BindingLosses(nn.Module):
    """Two losses beside the answers' that teach the model which event a query means, both at the positions that
    predict the answer's first UNANSWERED tokens, where no digit of it is there to look the seconds up by:
    `recall`: linear heads (trained with the model, not kept) name the query's colour, shape and sound (or none) from
    the stream entering layer `recall_layer`, so the answer's positions hold what was asked;
    `ground`: minus the log of the share the last `ground_layers` layers' context softmax puts on the keys of the
    answer's first range (the frames' for a shape, the audio's for a sound, both for a shape heard with a sound),
    so their attention finds it. Trained without either, the answers' positions never learn which colour was asked,
    and with one alone the model still answers another event of the clip nearly as often."""

    def __init__(self, model: nn.Module, ground_layers: int, recall_layer: int):
        super().__init__()
        self.heads = nn.Linear(model.config.hidden_size, sum(len(group) + 1 for group in WORDS))
        self.calls: list[dict] = []  # the supervised layers' context queries and keys, this forward
        self.streams: list[Tensor] = []  # the stream entering `recall_layer`, this forward
        for layer in model.model.layers[-ground_layers:]:
            layer.self_attn.op = self.recording
        model.model.layers[recall_layer].input_layernorm.register_forward_hook(
            lambda _module, inputs, _output: self.streams.append(inputs[0])
        )

    def recording(self, *args, **options) -> Tensor:
        self.calls.append({"q": args[4], "k": args[5], "scale": options["scale"], "softcap": options["softcap"]})
        return attention.dattn_op(*args, **options)

    def clear(self) -> None:
        self.calls.clear()
        self.streams.clear()

    def forward(self, queries: list[dict], labels: Tensor, segments: Tensor, frames: int) -> tuple[Tensor, Tensor]:
        """(ground, recall) after the model's forward on the rows `labels` (supervised_batch's) of `queries`."""
        predicting = nn.functional.pad(labels[:, 1:] != -100, (0, 1))
        first = predicting & (predicting.cumsum(1) <= UNANSWERED)
        return self.ground(queries, first, segments, frames), self.recall(queries, first)

    def recall(self, queries: list[dict], first: Tensor) -> Tensor:
        stream = self.streams[-1]
        named = torch.tensor([[next((n for n, word in enumerate(group) if word in q["query"].lower()), len(group))
                               for group in WORDS] for q in queries])  # fmt: skip
        named = named.repeat_interleave(first.sum(1), 0)
        logits = self.heads(stream[first]).split([len(group) + 1 for group in WORDS], dim=-1)
        return torch.stack([nn.functional.cross_entropy(part, named[:, n]) for n, part in enumerate(logits)]).mean()

    def ground(self, queries: list[dict], first: Tensor, segments: Tensor, frames: int) -> Tensor:
        second, losses = key_seconds(segments, frames, queries[0]["duration"]), []
        for stream, modalities in ((FRAMES, ("vision", "vision+audio")), (AUDIO, ("audio", "vision+audio"))):
            keys = segments[0] == stream.segment
            rows = [i for i, q in enumerate(queries) if q["query_modality"] in modalities]
            if not rows or not keys.any():
                continue
            truth = torch.stack([keys & (second >= queries[i]["gt"][0][0]) & (second < queries[i]["gt"][0][1])
                                 for i in rows])[:, None, None, None]  # fmt: skip
            for call in self.calls:
                s = attention._logits(call["q"][rows], call["k"][rows], call["scale"], call["softcap"])
                s = s.masked_fill(~keys, float("-inf"))  # (rows, kv heads, group, T, V): this stream's softmax
                share = s.masked_fill(~truth, float("-inf")).logsumexp(-1) - s.logsumexp(-1)
                losses.append(-share.mean((1, 2))[first[rows]].mean())
        return torch.stack(losses).mean()


def train(folder: Path, clips: range, steps: int, lr: float, scratch: Path, ground: float, ground_layers: int,
          recall: float, recall_layer: int) -> nn.Module:  # fmt: skip
    """AdamW with a one-cycle schedule, a clip a step (its context once for all its queries): the train split's
    `clips` in a seeded order, each made afresh when its turn comes; `ground`, `recall`: BindingLosses' weights."""
    torch.manual_seed(0)
    model, order = load_model(folder).train(), random.Random(0)
    processor = DAttnProcessor.from_pretrained(folder, trust_remote_code=True)
    binding = BindingLosses(model, ground_layers, recall_layer) if ground or recall else None
    trained = [*model.parameters(), *(binding.parameters() if binding else ())]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    started, seeds = time.perf_counter(), []
    for step in range(steps):
        if not seeds:
            seeds = order.sample(clips, len(clips))
        media, rows, queries = example(seeds.pop(), scratch, processor, processor.model_config.family)
        ids, mask, labels = supervised_batch(rows)
        context, segments = model.model.encode_inputs(**media)
        expand = lambda t: t.expand(len(ids), *t.shape[1:])  # noqa: E731
        context = [tuple(expand(t) for t in layer) for layer in context]
        if binding:
            binding.clear()
        logits = model(ids, attention_mask=mask, context_key_values=context, context_mask=expand(segments)).logits
        loss = answers = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        shown = ""
        if binding:
            grounding, recalled = binding(queries, labels, segments, int(media["video_frames"][0]))
            loss = loss + ground * grounding + recall * recalled
            shown = f"  grounding {grounding.item():.3f}  recall {recalled.item():.3f}"
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - started
            print(f"step {step:5d}  loss {answers.item():.3f}{shown}  {elapsed:6.0f} s", flush=True)
    return model.eval()


def retrieve_and_score(folder: Path, corpus: Path, name: str, out: Path) -> dict:
    predictions, truth = out / f"{name}.jsonl", corpus / "held-out.json"
    command = [sys.executable, "-m", "dattn_export"]
    retrieve = ["retrieve", folder, "--benchmark", truth, "--videos", corpus / "videos", "-o", predictions]
    subprocess.run([*command, *retrieve, "--max-new-tokens", str(ANSWER_TOKENS)], check=True)
    scored = subprocess.run([*command, "score", predictions, "--gt", truth, "--json"], check=True, capture_output=True,
                            text=True)  # fmt: skip
    (out / f"{name}.score.json").write_text(scored.stdout)
    return json.loads(scored.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=["mistral", "gemma2"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--clips", type=int, help="distinct train clips (default: one a step, none seen twice)")
    parser.add_argument("--held-out", type=int, default=HELD_OUT_CLIPS)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--init", type=Path, help="start from these weights (a run's {family}.safetensors)")
    parser.add_argument("--first-clip", type=int, default=0, help="the train clips' first (default 0)")
    parser.add_argument("--ground", type=float, default=1.0, help="BindingLosses' grounding weight (default 1; 0 off)")
    parser.add_argument("--ground-layers", type=int, default=1, help="the last layers it holds (default 1)")
    parser.add_argument("--recall", type=float, default=1.0, help="BindingLosses' recall weight (default 1; 0 off)")
    parser.add_argument("--recall-layer", type=int, default=2, help="the layer whose input names the query's words")
    parser.add_argument("--threads", type=int, default=1, help="torch's: one trains as fast as two at this size")
    args = parser.parse_args()
    first = SPLITS["train"] + args.first_clip
    clips = range(first, first + (args.clips or args.steps))
    if clips.stop > SPLITS["held-out"]:  # the train split's seeds end where the held-out split's begin
        parser.error(
            f"train clips {clips.start}-{clips.stop - 1} reach the held-out split's seeds ({SPLITS['held-out']} on)"
        )
    torch.set_num_threads(args.threads)
    out, corpus = args.out, args.out / "corpus"
    write_benchmark(corpus, "held-out", args.held_out)
    untrained = convert(write_retrieval_checkpoint(out / "checkpoint", args.family), out / "untrained").out
    start = untrained
    if args.init:
        start = convert(write_retrieval_checkpoint(out / "init-checkpoint", args.family, args.init), out / "init").out
    started = time.perf_counter()
    (out / "scratch").mkdir(exist_ok=True)
    model = train(start, clips, args.steps, args.lr, out / "scratch", args.ground, args.ground_layers, args.recall,
                  args.recall_layer)  # fmt: skip
    seconds = time.perf_counter() - started
    weights = out / f"{args.family}.safetensors"
    save_file(saved_state_dict(model), weights, metadata={"format": "pt"})
    trained = convert(write_retrieval_checkpoint(out / "trained-checkpoint", args.family, weights), out / "trained").out
    scores = {name: retrieve_and_score(folder, corpus, name, out)["overall"]
              for name, folder in (("untrained", untrained), ("trained", trained))}  # fmt: skip
    begun = f" from {args.init}" if args.init else ""
    print(f"\n{args.family}: {args.steps} steps on {len(clips)} clips{begun} in {seconds:.0f} s; held-out "
          f"({args.held_out} clips), VUE-TR's areas under the curves:")  # fmt: skip
    for name, figures in scores.items():  # precision: None where no query was answered with a range
        shown = {metric: "-" if figures[metric] is None else f"{figures[metric]:.3f}" for metric in METRICS}
        print(f"  {name:9s}  " + "  ".join(f"{metric} {value}" for metric, value in shown.items()))
    shipped = trained_weights(args.family)
    same = shipped.is_file() and filecmp.cmp(weights, shipped, shallow=False)
    print(f"{weights}: {'the same bytes as' if same else 'not the bytes of'} the demo's {shipped}")


if __name__ == "__main__":
    main()
