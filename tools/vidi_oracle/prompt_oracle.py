"""The released inference scripts' prompts as an oracle: the ids Vidi's own `preprocess_chat` and
`tokenizer_image_token` make for a question about a video, and for a retrieval query in the script's own task
template (its lines run as they are, taken from `ask` in inference.py; the video's length from its own `get_length`,
which calls ffprobe). Run in the released family's venv (README.md), on a tokenizer folder with a chat template.
usage: VIDI_SRC=... python prompt_oracle.py {gemma2|mistral} TOKENIZER VIDEO OUT.json"""

import ast
import json
import os
import sys
import types
from pathlib import Path

family, tokenizer_folder, video, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
VIDI_SRC = Path(os.environ["VIDI_SRC"])  # a checkout of github.com/bytedance/vidi
# the released tree, its package as a shell (its __init__ imports the whole model), and the script with `ask`
ROOTS = {
    "mistral": (VIDI_SRC / "Vidi_7B", "model", "model.txt_utils", "Vidi_7B/inference.py"),
    "gemma2": (VIDI_SRC / "Vidi1.5_9B", "vidi", "vidi.dataset.txt_utils", "Vidi1.5_9B/vidi/eval/inference.py"),
}
root, package, txt_utils, script = ROOTS[family]
sys.path.insert(0, str(root))
for name in (package, f"{package}.dataset"):
    shell = types.ModuleType(name)
    shell.__path__ = [str(root / Path(*name.split(".")))]
    sys.modules[name] = shell

import importlib  # noqa: E402

from transformers import AutoTokenizer  # noqa: E402

released = importlib.import_module(txt_utils)
constants = importlib.import_module(f"{package}.constants")

tree = ast.parse((VIDI_SRC / script).read_text())
functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
ask_lines = {  # the statements of `ask` that make the prompt's text, by the name they assign
    node.targets[0].id: node
    for node in functions["ask"].body
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
}
namespace = {"subprocess": __import__("subprocess"), **vars(released), **vars(constants)}
exec(compile(ast.Module([functions["get_length"]], []), script, "exec"), namespace)


def run_lines(names: list[str], **values) -> dict:
    """The named statements of `ask`, run in order with `values` (and the tokenizer) in scope."""
    scope = {**namespace, **values}
    exec(compile(ast.Module([ask_lines[name] for name in names], []), script, "exec"), scope)
    return scope


tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
length = namespace["get_length"](video)
record = {"family": family, "video": Path(video).name, "length": length, "cases": []}
for kind, text in [
    ("question", "What happens in the video, and what do you hear?"),
    ("query", "a man opens the door."),
    ("query", "the red circle moves to the left"),
]:
    if kind == "query":
        scope = run_lines(["question_tmp", "qs", "prompt"], question=text, length=length, tokenizer=tokenizer)
    else:  # the script's own lines after its task template, with the question in its place
        scope = run_lines(["qs", "prompt"], question_tmp=text, tokenizer=tokenizer)
    ids = released.tokenizer_image_token(scope["prompt"], tokenizer, constants.IMAGE_TOKEN_INDEX)
    record["cases"].append({"kind": kind, "text": text, "prompt": scope["prompt"], "input_ids": ids})
out.write_text(json.dumps(record, indent=1) + "\n")
print(f"{out}: {len(record['cases'])} prompts, video length {length}")
