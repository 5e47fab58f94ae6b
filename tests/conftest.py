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


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory, worker_id):
    """Getting started's pipeline (docs/getting-started.md), run once per test run as a user runs it: its folder
    (dattn-demo/, converted/, onnx/), each command's stdout and stderr kept in commands/. The xdist workers share it;
    tests copy what they change."""
    from helpers.guides import run_getting_started

    base = tmp_path_factory.getbasetemp()
    return run_getting_started(base if worker_id == "master" else base.parent)


@pytest.fixture(scope="session")
def real_checkpoints(tmp_path_factory, worker_id):
    """What DeepSpeed and the Trainer write, trained once per run: the xdist workers share one folder."""
    from helpers.real_checkpoints import real_checkpoints as trained

    base = tmp_path_factory.getbasetemp()
    return trained(base if worker_id == "master" else base.parent)
