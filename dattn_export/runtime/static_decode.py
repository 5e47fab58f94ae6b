"""Greedy decoding at memory speed, gpt-fast's way, for the PyTorch model on a GPU: the text K/V in buffers of a
fixed length, the context's K/V made once and kept, so that every decode step has the same shapes and is captured
once in a CUDA graph, then replayed: no Python and no launch of its own per op and token.

The prompt is prefilled as the reference prefills it, then copied into the buffers. A decode step writes its token's
K/V at its slot (`modeling_dattn.StaticKV`), and the attention reads every slot, the attention mask marking those
written. The op measures a sliding window from the last slot of its keys, which is not the token's in a buffer, so
the window is folded into the mask instead (`windowed`). The same ops on the same values as the dynamic cache's
decoding: tests/test_static_decode.py holds the tokens and every step's logits to `greedy`'s."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..modeling.attention import dattn_op
from ..modeling.modeling_dattn import StaticKV
from ..plugins.contract import using_op


def windowed(op: Callable, slots: Tensor, slot: Tensor) -> Callable:
    """`op` for a decode step at `slot` of buffers of `len(slots)` slots: a window becomes a key mask (a query at
    slot i sees slot j when i - j < window), the op then applying none."""

    def step_op(q, k, v, key_mask, *context, window=None, causal_context=False, **keywords):
        if window:
            if causal_context:  # the context keys' slots would move too: not a decode any released model does
                raise ValueError("a static cache does not take a window over causal context keys")
            key_mask = key_mask.bool() & (slots > slot - window)[None, :]
        return op(q, k, v, key_mask, *context, window=None, causal_context=causal_context, **keywords)

    return step_op


@dataclass
class Decoded:
    tokens: list[list[int]]  # per batch row, the generated ids (up to and with an EOS)
    step_logits: list[Tensor] = field(default_factory=list)  # each step's next-token logits (B, vocab), fp32, if kept
    seconds: dict[str, float] = field(default_factory=dict)  # prefill (to the first token), capture, decode steps
    steps: int = 0  # decode steps run after the first token


def synchronized(device) -> float:
    """The time once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def static_generate(model, input_ids: Tensor, max_new_tokens: int, context_key_values=None, context_mask=None,
                    eos_token_id: int | None = None, op: Callable = dattn_op, cuda_graph: bool = False,
                    keep_logits: bool = False, attention_mask: Tensor | None = None,
                    forced: list[int] | None = None) -> Decoded:  # fmt: skip
    """Greedy decoding of `input_ids` (B, T; `attention_mask` marks a left-padded batch's tokens) with `op` as every
    attention (the reference's math by default; the Triton kernel on a GPU), the decode steps in fixed-size buffers
    and, with `cuda_graph`, replayed from one capture. The context (`context_key_values`, `context_mask`, as
    `greedy` takes them) stays where it is: made once. `forced`: the tokens to feed (a batch of one), teacher
    forcing in place of the greedy choice, to compare each step's logits with another model's on the same tokens."""
    if model.config.wings_rank:
        raise ValueError("static decoding does not take WINGS learners (their cache grows): decode with `greedy`")
    batch, prompt = input_ids.shape
    length, device = prompt + max_new_tokens, input_ids.device
    context = dict(context_key_values=context_key_values, context_mask=context_mask)
    prompt_mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    start = synchronized(device)
    with using_op(model, op):
        out = model(input_ids, attention_mask=prompt_mask, **context)
    buffers = []
    for k, v in out.cache:
        key = k.new_zeros(*k.shape[:2], length, k.shape[3])
        value = v.new_zeros(*v.shape[:2], length, v.shape[3])
        key[:, :, :prompt], value[:, :, :prompt] = k, v
        buffers.append((key, value))
    written = torch.zeros(batch, length, dtype=torch.bool, device=device)
    written[:, :prompt] = prompt_mask
    slot = torch.full((1,), prompt, dtype=torch.long, device=device)  # where the next token's K/V go
    slots = torch.arange(length, device=device)
    choose = lambda logits, number: (
        logits.argmax(-1, keepdim=True) if forced is None else torch.tensor([[forced[number]]], device=device)
    )
    token = choose(out.logits[:, -1], 0)

    def step() -> Tensor:
        written.index_fill_(1, slot, True)
        past = [StaticKV(key, value, slot) for key, value in buffers]
        with using_op(model, windowed(op, slots, slot)):
            return model(token, attention_mask=written, past_key_values=past, **context).logits[:, -1].float()

    decoded = Decoded([[] for _ in range(batch)], [out.logits[:, -1].float()] if keep_logits else [])
    decoded.seconds["prefill"] = (captured := synchronized(device)) - start
    run = capture(step) if cuda_graph and max_new_tokens > 1 else step
    decoded.seconds["capture"] = (stepping := synchronized(device)) - captured
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for number in range(max_new_tokens):
        for row, value in enumerate(token[:, 0].tolist()):
            if not done[row]:
                decoded.tokens[row].append(value)
        if eos_token_id is not None:
            done |= token[:, 0] == eos_token_id
        if number == max_new_tokens - 1 or bool(done.all()):
            break
        logits = run()
        decoded.steps += 1
        if keep_logits:
            decoded.step_logits.append(logits.clone())
        token.copy_(choose(logits, number + 1))
        slot.add_(1)
    decoded.seconds["steps"] = synchronized(device) - stepping
    return decoded


def capture(step: Callable[[], Tensor]) -> Callable[[], Tensor]:
    """`step` captured in a CUDA graph after warm-up runs on a side stream (PyTorch's recipe: the allocations and the
    kernels' first launches happen outside the capture): the returned function replays it and returns its output.
    The warm-up runs write the step's slot too; the step after them writes it again, with the same values."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()

    def replay() -> Tensor:
        graph.replay()
        return output

    return replay
