"""torch.ops.dattn.decomposed_attention: registered, traceable, and equal to the reference on every device."""

import pytest
import torch
from helpers.checks import context_segments

from dattn_export.plugins import contract
from dattn_export.plugins.contract import Attributes
from dattn_export.plugins.torch_op import decomposed_attention

gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU: the CUDA dispatch runs the Triton kernel"
)


def inputs(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)
    key_mask = torch.ones(2, 9, dtype=torch.bool, device=device)
    key_mask[0, :2] = False
    return (
        rand(2, 8, 5, 64),
        rand(2, 2, 9, 64),
        rand(2, 2, 9, 64),
        key_mask,
        rand(2, 8, 5, 64),
        rand(2, 2, 33, 64),
        rand(2, 2, 33, 64),
        torch.ones(2, 33, dtype=torch.bool, device=device),
    )


def test_cpu_dispatch_is_the_reference_and_the_op_is_well_formed():
    args = inputs()
    torch.testing.assert_close(
        decomposed_attention(*args, 0.125, 3.0, 4, "sum"),
        contract.reference(args, Attributes(0.125, 3.0, 4, "sum")),
        atol=0,
        rtol=0,
    )
    torch.library.opcheck(decomposed_attention, (*args, 0.125, 0.0, 0, "alpha", 0))
    assert torch.ops.dattn.decomposed_attention.default is not None
    # a video model's two context segments: the last attribute, keyword or positional
    segmented = (*args[:7], context_segments(2, [20, 13]))
    expected = contract.reference(segmented, Attributes(0.125, merge="sum", num_contexts=2))
    torch.testing.assert_close(decomposed_attention(*segmented, 0.125, merge="sum", num_contexts=2), expected)
    torch.library.opcheck(decomposed_attention, (*segmented, 0.125, 0.0, 0, "sum", 0, 1, 2))


def test_the_op_traces_into_an_exported_program():
    class Attend(torch.nn.Module):
        def forward(self, *args):
            return torch.ops.dattn.decomposed_attention(*args, 0.125)

    program = torch.export.export(Attend(), inputs())
    assert any("dattn.decomposed_attention" in str(node.target) for node in program.graph.nodes)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype, atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_cuda_dispatch_runs_the_kernel(dtype, atol):
    args = inputs("cuda", dtype)
    got = decomposed_attention(*args, 0.125, 50.0, 0, "alpha")
    expected = contract.reference(args, Attributes(0.125, softcap=50.0))
    assert (got.float() - expected.float()).abs().max().item() <= atol
