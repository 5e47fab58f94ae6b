import os

# Triton kernels run on CPU tensors through its interpreter where there is no GPU. Triton reads this once,
# at its first use, so it is set before anything imports it.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(params=["mistral", "gemma2"])
def family(request):
    return request.param
