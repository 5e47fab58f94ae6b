"""Trained tiny models and damaged quantized exports, for the accuracy gate's tests and its bench.

A random model's next-token distributions are nearly flat, so a gate on them means nothing: the gate is held on
tiny models trained first on a few questions about the demo image and their answers, asked through the checkpoint's
chat template as the gate asks its own, until they predict the answers with confidence (a loss under 0.1), as a
trained model predicts its domain; and no further: trained on, they give their answers' tokens a probability of 0.995
and more, which even damaged weights keep, and a gate on them would pass those too."""

import shutil
from pathlib import Path

import numpy as np
import onnx
import torch

from dattn_export.checkpoints.source import load_model
from dattn_export.demo_model import DEMO_TURNS, supervised_batch
from dattn_export.modeling.marked_prompts import prompt_ids
from dattn_export.processing import load_tokenizer
from dattn_export.prompts import asked_texts
from helpers.builders import picture_pixels

CONFIDENT = 0.1  # the answers' loss (nats a token) training stops under
CORPORA = {  # (question, answer) turns about the media
    "demo": DEMO_TURNS,  # the demo's, whose questions the gate asks too
    "colours": [
        ("What colour is the circle?", "The circle is red, and the background fades from green to blue."),
        ("Is there any writing in the image?", "No writing, only a shape on a smooth gradient."),
        ("Where is the circle?", "In the centre, a quarter of the way in from each edge."),
    ],
}


def question_texts(turns: list[tuple[str, str]], tokenizer, family) -> list[str]:
    """The turns' questions as the checkpoint is asked them (its chat template, the media's marker first): the
    prompts their answers are trained after."""
    return asked_texts([question for question, _ in turns], tokenizer, family)


def train(folder: Path, turns: list[tuple[str, str]], steps: int = 150, seed: int = 0, video: Path | None = None):
    """The model of the checkpoint at `folder` trained on the answers of `turns` (a CORPORA entry; the image as
    context; a video model: the frames and sound of `video`, as the processor prepares them) until their loss is
    under CONFIDENT (at most `steps` AdamW steps); returns it."""
    torch.manual_seed(seed)
    model = load_model(folder).train()
    tokenizer = load_tokenizer(folder, model.config)
    answers = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for _, a in turns]
    prompts = [prompt_ids(tokenizer, text) for text in question_texts(turns, tokenizer, model.config.family)]
    ids, mask, labels = supervised_batch(list(zip(prompts, answers)))
    if video is None:
        pixels = picture_pixels(folder / "demo.png", model.config, folder)
        media = {"pixel_values": pixels.expand(len(ids), -1, -1, -1, -1)}
    else:
        from dattn_export.modeling.processing_dattn import DAttnProcessor

        processor = DAttnProcessor.from_pretrained(folder, trust_remote_code=True)
        given = processor(text="<image>", videos=str(video), return_tensors="pt")
        one = {key: value for key, value in given.items() if key not in ("input_ids", "attention_mask")}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        if video is not None:  # the video's context once a step, for every line of the corpus
            context, segments = model.model.encode_inputs(**one)
            expand = lambda t: t.expand(len(ids), *t.shape[1:])  # noqa: E731
            context = [tuple(expand(t) for t in layer) for layer in context]
            media = {"context_key_values": context, "context_mask": expand(segments)}
        logits = model(ids, attention_mask=mask, **media).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        if loss.item() < CONFIDENT:
            return model.eval()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    raise AssertionError(f"the answers' loss is {loss.item():.3f} after {steps} steps")


def quantized_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "MatMulNBits"]


def set_initializer(model: onnx.ModelProto, name: str, value: np.ndarray) -> None:
    tensor = next(t for t in model.graph.initializer if t.name == name)
    tensor.CopyFrom(onnx.numpy_helper.from_array(value, name))


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name)).copy()


def shift_scales(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> None:
    """Each node's scales shifted by one output row: a quantizer that misaligns its scales."""
    for node in nodes:
        size = next(a.i for a in node.attribute if a.name == "N")
        scales = initializer(model, node.input[2])
        set_initializer(model, node.input[2], np.roll(scales.reshape(size, -1), 1, axis=0).reshape(scales.shape))


def swap_layers(model: onnx.ModelProto, layers: int) -> None:
    """The quantized weights of the first two decoder layers exchanged (their MatMulNBits nodes come in order)."""
    nodes = quantized_matmuls(model)
    per_layer = len(nodes) // layers
    for first, second in zip(nodes[:per_layer], nodes[per_layer : 2 * per_layer]):
        for a, b in zip(first.input[1:], second.input[1:]):
            value_a, value_b = initializer(model, a), initializer(model, b)
            set_initializer(model, a, value_b)
            set_initializer(model, b, value_a)


def broken_export(source: Path, out: Path, damage: str) -> Path:
    """A copy of a quantized export with its decoder damaged: `shift-one` (the first layer's down projection's
    scales shifted a row), `shift-three` (the second layer's q, v and down projections'), `shift` (every quantized
    matrix's), `swap` (the first two layers exchanged)."""
    shutil.copytree(source, out)
    model = onnx.load(out / "decoder.onnx")
    nodes = quantized_matmuls(model)
    layers = len(nodes) // 7  # q, k, v, o, gate, up, down
    shifted = {"shift": nodes, "shift-one": nodes[6:7], "shift-three": [nodes[7], nodes[9], nodes[13]]}
    if damage == "swap":
        swap_layers(model, layers)
    else:
        shift_scales(model, shifted[damage])
    onnx.save(model, out / "decoder.onnx")
    return out


def nodes_of(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type]


def packed_values(model: onnx.ModelProto, node: onnx.NodeProto) -> tuple[np.ndarray, int]:
    """A MatMulNBits node's integers (N, K rounded up to blocks) and its bits."""
    bits = next(a.i for a in node.attribute if a.name == "bits")
    packed = initializer(model, node.input[1])
    if bits == 8:
        return packed.reshape(len(packed), -1).astype(np.int32), bits
    return np.stack([packed & 15, packed >> 4], -1).reshape(len(packed), -1).astype(np.int32), bits


def set_packed_values(model: onnx.ModelProto, node: onnx.NodeProto, values: np.ndarray, bits: int) -> None:
    shape = initializer(model, node.input[1]).shape
    packed = values if bits == 8 else values[:, 0::2] | (values[:, 1::2] << 4)
    set_initializer(model, node.input[1], packed.astype(np.uint8).reshape(shape))


def transpose_block(model: onnx.ModelProto, node: onnx.NodeProto, block: int) -> None:
    """The node's first block x block tile of integers (rows 0..block of its output features, the first block of
    each) transposed: a quantizer that writes one block in the wrong order."""
    values, bits = packed_values(model, node)
    values[:block, :block] = values[:block, :block].T.copy()
    set_packed_values(model, node, values, bits)


def shift_zero_point(model: onnx.ModelProto, node: onnx.NodeProto) -> None:
    """The node's first block's zero point one higher (wrapping within its bits): an asymmetric export's bug."""
    bits = next(a.i for a in node.attribute if a.name == "bits")
    points = initializer(model, node.input[3])
    first = points[0, 0]
    if bits == 8:
        points[0, 0] = (int(first) + 1) % 256
    else:
        points[0, 0] = (first & 0xF0) | (((first & 15) + 1) % 16)
    set_initializer(model, node.input[3], points)


def take_matrix(model: onnx.ModelProto, into: onnx.NodeProto, source: onnx.NodeProto) -> None:
    """`into`'s packed weights, scales (and zero points) replaced by `source`'s: a matrix from another layer."""
    for a, b in zip(into.input[1:], source.input[1:]):
        set_initializer(model, a, initializer(model, b))


FIRST, SECOND = "model.layers.0.self_attn.q_proj.", "model.layers.1.self_attn.q_proj."


def corrupt(folder: Path, damage: str, scheme: str) -> str:
    """One damage written into a folder `quantize` wrote (a real tool cannot write these); returns the matrix it
    damages: `scales a row off`, `a transposed block`, `a matrix from another layer` (the first layer's q
    projection's), `swapped layers` (the first two layers' q projections exchanged), `every matrix's scales a row
    off`, `every matrix swapped` (the first two layers' projections all exchanged)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)

    def parts(prefix: str) -> list[str]:
        return [name.removeprefix(prefix) for name in tensors if name.startswith(prefix)]

    def exchange(first: str, second: str) -> None:
        for part in parts(first):
            tensors[first + part], tensors[second + part] = tensors[second + part], tensors[first + part]

    if damage == "scales a row off":
        tensors[FIRST + "weight_scale"] = tensors[FIRST + "weight_scale"].roll(1, 0)
    elif damage == "every matrix's scales a row off":
        for name in [name for name in tensors if name.startswith("model.layers.") and name.endswith("weight_scale")]:
            tensors[name] = tensors[name].roll(1, 0)
    elif damage == "swapped layers":
        exchange(FIRST, SECOND)
    elif damage == "every matrix swapped":
        for name in [name.removesuffix("weight_scale") for name in tensors if name.startswith("model.layers.0.")]:
            if name.endswith("proj."):
                exchange(name, name.replace("layers.0.", "layers.1."))
    elif damage == "a transposed block":
        if scheme == "w4a16":
            shape = tuple(tensors[FIRST + "weight_shape"].tolist())
            values = unpack_from_int32(tensors[FIRST + "weight_packed"], 4, torch.Size(shape))
            values[:32, :32] = values[:32, :32].T.clone()
            tensors[FIRST + "weight_packed"] = pack_to_int32(values, 4)
        else:
            weight = tensors[FIRST + "weight"]
            weight[:32, :32] = weight[:32, :32].T.clone()
    elif damage == "a matrix from another layer":
        for part in parts(FIRST):
            tensors[FIRST + part] = tensors[SECOND + part].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    return FIRST + "weight"
