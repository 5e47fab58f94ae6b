"""Build every graph of an exported folder with a TensorRT-family builder and print, as JSON, each engine's size and
the types of its float inputs and outputs (of the parsed network, which a strongly typed build keeps: no runtime
object is made, which a machine without a GPU cannot free safely).

Run as a script in a child process: TensorRT objects never live in the test process."""

import argparse
import json
import sys
from pathlib import Path

from dattn_export.artifacts import OnnxManifest
from dattn_export.runtime.tensorrt import import_tensorrt
from dattn_export.stages.trt_build import Limits, build_serialized


def float_types(trt, path: Path) -> list[str]:
    """The types of the network's float inputs and outputs, as TensorRT's parser types them."""
    logger = trt.Logger(trt.Logger.ERROR)
    network = trt.Builder(logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert trt.OnnxParser(network, logger).parse_from_file(str(path))
    tensors = [network.get_input(i) for i in range(network.num_inputs)]
    tensors += [network.get_output(i) for i in range(network.num_outputs)]
    floats = {trt.float32, trt.float16, trt.bfloat16}
    return sorted({t.dtype.name for t in tensors if t.dtype in floats})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--module", default="tensorrt")
    args = parser.parse_args()
    trt = import_tensorrt(args.module)
    limits = Limits(max_batch=2, max_text_tokens=64, max_context_tokens=64)
    manifest = OnnxManifest.read(args.folder)
    engines = {}
    for name, graph in manifest.graphs.items():
        path = args.folder / graph.file
        engines[name] = {
            "bytes": len(build_serialized(trt, path, graph.inputs, limits)),
            "float_types": float_types(trt, path),
        }
    json.dump(engines, sys.stdout)
