"""`dattn-export`: one module per command, each holding its options and its rendering; the work lives in the
package's modules (`stages/`). Heavy imports (torch, transformers) happen inside the commands so `--help` stays fast.
"""

from . import (
    analyze,
    convert,
    demo,
    generate,
    info,
    onnx,
    push,
    quantize,
    retrieve,
    score,
    serve,
    trt,
    validate,
    verify,
)
from .common import FAMILIES, main

# in the pipeline's order (`dattn-export --help` lists them by name)
for command in (
    demo.demo,
    generate.generate,
    info.info,
    convert.convert,
    verify.verify,
    quantize.quantize,
    onnx.onnx_command,
    validate.validate,
    push.push,
    trt.trt,
    analyze.analyze,
    retrieve.retrieve,
    score.score,
    serve.serve,
):
    main.add_command(command)

__all__ = ["FAMILIES", "main"]
