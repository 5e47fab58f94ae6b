"""`serve`: a converted folder under `vllm serve`, which finds our model through the plugin this package registers
(the `vllm.general_plugins` entry point). The folder is checked first, so what the plugin cannot serve is refused
in one line before vLLM starts; then this process becomes vLLM's own CLI."""

from __future__ import annotations

import difflib
import json
import os
import sys
from pathlib import Path

from ..checkpoints.source import folder_config
from ..errors import InputError
from ..extras import require
from ..folders import CONVERTED, check_kind
from ..processing import load_processor
from ..sidefiles import read_json
from ..ui import err
from ..vllm_plugin import DEFAULT_CONTEXT_CACHE_GIB, MEDIA_CONNECTOR, VIDEO_BACKEND, unsupported
from ..vllm_plugin.logs import QUIET_ENVIRONMENT
from ..vllm_plugin.video import encoder_token_budget, max_video_frames

NO_CHAT_TEMPLATE = (
    "note: {folder} has no chat template: vLLM answers completion requests (a finished prompt, <image> where the "
    "media goes) and refuses chat requests; pass the model's with --chat-template FILE"
)


def has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    tokenizer_config = folder / "tokenizer_config.json"
    return tokenizer_config.is_file() and bool(read_json(tokenizer_config).get("chat_template"))


def cpu_environment(tensor_parallel_size: int) -> dict[str, str]:
    """What vLLM's CPU backend needs: KV cache space (GiB), and the cores each rank binds, split evenly (vLLM's
    "auto" leaves a core to the API server, half of a 2-core machine)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // tensor_parallel_size)
        ranks = [cores[r * share : (r + 1) * share] or cores[-1:] for r in range(tensor_parallel_size)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(f"{part[0]}-{part[-1]}" for part in ranks)
    return env


def option_value(args: tuple[str, ...], name: str) -> str | None:
    """The value `vllm serve` takes for option `name` among `args` (`--name V` or `--name=V`, the last one)."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def requested_frames(extra: tuple[str, ...]) -> int | None:
    """The frame limit `--limit-mm-per-prompt '{"video": {"count": 1, "num_frames": N}}'` asks for, if any (a
    malformed option is vLLM's to report)."""
    try:
        limits = json.loads(option_value(extra, "--limit-mm-per-prompt") or "{}")
    except ValueError:
        return None
    video = limits.get("video") if isinstance(limits, dict) else None  # {"video": 2}: a count alone
    frames = video.get("num_frames") if isinstance(video, dict) else None
    return frames if isinstance(frames, int) else None


def longest_video_budget(processor, frames: int, extra: tuple[str, ...]) -> list[str]:
    """vLLM takes a request's encoder tokens in one step (no chunked prefill on its encoder-decoder path), so its
    token budget must hold those of the video of at most `frames` frames that has the most (`longest_video`); its
    own default is sized by the context length (--max-model-len), which is larger unless set small
    (`encoder_token_budget`). The option where it is needed, else nothing."""
    config = processor.model_config
    tokens = encoder_token_budget(config, frames, processor.feature_extractor.hop_length)
    given = option_value(extra, "--max-model-len") or ""
    context = int(given) if given.isdigit() else config.max_position_embeddings  # "32k", "auto": the config's
    return ["--max-num-batched-tokens", str(tokens)] if tokens > context else []


OUR_OPTIONS = ("--tensor-parallel-size", "-tp", "--host", "--port")  # what `dattn-export serve` itself parses


def check_vllm_options(extra: tuple[str, ...]) -> None:
    """Every option passed on must be one of vLLM's server (read from vLLM's own parser): a typo answers here in one
    line, not in vLLM's usage after it has started."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # another vLLM layout: vLLM reports what it does not take
        return
    known = {name for action in make_arg_parser(FlexibleArgumentParser())._actions for name in action.option_strings}
    for arg in extra:
        name = arg.split("=", 1)[0]
        if not name.startswith("-") or name.lstrip("-").replace(".", "", 1).isdigit():  # a value, not an option
            continue
        if name not in known and name.replace("_", "-") not in known:  # vLLM reads --max_model_len as --max-model-len
            close = difflib.get_close_matches(name, [*OUR_OPTIONS, *known], n=1)
            hint = f": did you mean {close[0]}?" if close else " (see `vllm serve --help`)"
            raise InputError(name, f"is an option of neither `dattn-export serve` nor vLLM's server{hint}")


def vllm_serve_command(
    folder: Path,
    tensor_parallel_size: int,
    host: str,
    port: int,
    extra: tuple[str, ...],
    context_cache_gib: float | None = None,
    verbose: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` command line for a converted folder and the environment it runs in; refuses in one line
    what vLLM cannot serve. `context_cache_gib`: the plugin's context cache per rank (`vllm_plugin/context_cache.py`),
    set through vLLM's --hf-overrides; unless `verbose`, vLLM's warnings and errors alone (QUIET_ENVIRONMENT, where
    this environment does not set them), and not the deprecation warning of the server module it starts (below)."""
    check_kind(folder, "serve", (CONVERTED,))
    config = folder_config(folder)
    if reason := unsupported(config):
        raise InputError(folder / "config.json", f"vLLM cannot serve this model: {reason}")
    require("vllm")
    check_vllm_options(extra)
    # `vllm serve` itself: its CLI entry point reads the `vllm` package's version, which vllm-cpu 0.32 (whose
    # distribution is named vllm-cpu) does not have, so the server module it starts is run directly
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    command += ["--tensor-parallel-size", str(tensor_parallel_size), "--host", host, "--port", str(port)]
    if not has_chat_template(folder) and "--chat-template" not in extra:
        err.print(NO_CHAT_TEMPLATE.format(folder=folder), markup=False)
    if context_cache_gib is not None:
        if option_value(extra, "--hf-overrides") is not None:
            raise InputError("--hf-overrides", 'given with --context-cache-gib: put "context_cache_gib" in it instead')
        command += ["--hf-overrides", json.dumps({"context_cache_gib": context_cache_gib})]
    if config.modality == "video":
        processor, frames = load_processor(folder, config), max_video_frames(requested_frames(extra))
        if option_value(extra, "--media-io-kwargs") is None:  # frames and sound, as Vidi reads them
            cache_gib = DEFAULT_CONTEXT_CACHE_GIB if context_cache_gib is None else context_cache_gib
            loader = {"video_backend": VIDEO_BACKEND, "cache_gib": cache_gib}  # decoded videos kept, by file content
            if square := processor.frame_square:
                loader["frame_size"] = square
            command += ["--media-io-kwargs", json.dumps({"video": loader | {"max_frames": frames}})]
        if option_value(extra, "--max-num-batched-tokens") is None:
            command += longest_video_budget(processor, frames, extra)
    import torch

    env = {"VLLM_MEDIA_CONNECTOR": os.environ.get("VLLM_MEDIA_CONNECTOR", MEDIA_CONNECTOR)}
    if not verbose:
        quiet = {**QUIET_ENVIRONMENT, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
        env |= {name: value for name, value in quiet.items() if name not in os.environ}
    if torch.cuda.is_available():
        return command + list(extra), env
    check_cpu_attention(folder, config)
    if four_bit(config) and option_value(extra, "--dtype") is None:  # vLLM's CPU 4-bit kernel: 16-bit activations
        command += ["--dtype", "bfloat16"]
    return command + list(extra), env | cpu_environment(tensor_parallel_size)


def four_bit(config) -> bool:
    """A folder `quantize` wrote with 4-bit weights (compressed-tensors' config)."""
    groups = (getattr(config, "quantization_config", None) or {}).get("config_groups", {})
    return any((group.get("weights") or {}).get("num_bits") == 4 for group in groups.values())


def check_cpu_attention(folder: Path, config) -> None:
    """vLLM's CPU attention has kernels for some head sizes only; another one fails at the first request and takes
    the engine down with it, so it is refused here, before the server starts."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: it reports what it cannot run
        return
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if config.head_dim not in sizes:
        runs = ", ".join(map(str, sizes))
        raise InputError(
            folder / "config.json",
            f"head_dim {config.head_dim}: vLLM's CPU attention has no kernel for it (it runs {runs}); serve this model "
            "on a GPU, or run it here with `dattn-export generate`",
        )
