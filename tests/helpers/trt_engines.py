"""Build every graph of an exported folder with a TensorRT-family builder and print the engine sizes as JSON.

Run as a script in a child process: TensorRT objects never live in the test process."""

import argparse
import json
import sys
from pathlib import Path

from dattn_export.artifacts import OnnxManifest
from dattn_export.runtime.tensorrt import import_tensorrt
from dattn_export.stages.trt_build import Limits, build_serialized

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--module", default="tensorrt")
    args = parser.parse_args()
    trt = import_tensorrt(args.module)
    limits = Limits(max_batch=2, max_text_tokens=64, max_context_tokens=64)
    manifest = OnnxManifest.read(args.folder)
    sizes = {
        name: len(build_serialized(trt, args.folder / graph.file, graph.inputs, limits))
        for name, graph in manifest.graphs.items()
    }
    json.dump(sizes, sys.stdout)
