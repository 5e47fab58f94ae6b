import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from pathlib import Path

# transformers copies the remote code of every folder it loads with trust_remote_code into its modules cache,
# under the folder's name (converted, w8a8): one of this process's own, not the home folder's, so that another
# clone's tests on the same machine never write the same files. Read when transformers is imported: set first.
os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="dattn-test-hf-modules-")
# Triton kernels run on CPU tensors through its interpreter where there is no GPU. Triton reads this once,
# at its first use, so it is set before anything imports it.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import settings

atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)

torch.set_num_threads(2)


def pytest_configure(config):
    """Property tests (test_mutations.py) try 250 examples each in the full run, 60 in the fast tier (-m "not slow");
    derandomized, so the same ones every run."""
    settings.register_profile("full", max_examples=250)
    settings.register_profile("fast", max_examples=60)
    settings.load_profile("fast" if config.getoption("markexpr") == "not slow" else "full")


# the modules that take longest in a full run (`--durations`), longest first: with `--dist loadfile` (pyproject.toml)
# a module goes to one worker whole, so its fixtures are built once, and the two workers take the longest first and
# the short rest as they free up, so that they finish together; test_bad_inputs.py early, as in the fast tier it is the
# first to ask for getting started's pipeline (a minute, which the other worker would otherwise wait for at the end)
LONGEST_FIRST = (
    "test_quantized_serving.py", "test_vllm.py", "test_onnx.py", "test_retrieve.py", "test_bad_inputs.py",
    "test_quantize.py", "test_convert_errors.py", "test_tensorrt_rtx.py", "test_released_prompts.py", "test_video.py",
    "test_memory.py", "test_hub_processor.py", "test_wings.py", "test_docs.py", "test_quantized_folders.py",
    "test_released.py", "test_cli.py", "test_genai.py", "test_push.py", "test_output_places.py", "test_first_hour.py",
    "test_images.py", "test_inputs.py", "test_score.py", "test_kernels.py", "test_families.py",
)  # fmt: skip


def random_order_seed(config) -> str | None:
    """The seed of the run's random order (pytest-random-order: --random-order, or a seed or bucket given), None
    when the run keeps LONGEST_FIRST's order."""
    try:
        from random_order.config import Config
    except ImportError:
        return None
    order = Config(config)
    return order.seed if order.is_enabled else None


def pytest_terminal_summary(terminalreporter, config):
    """A random order's seed, printed even with -q: `--random-order-seed=N` runs the same order again."""
    if (seed := random_order_seed(config)) is not None:
        terminalreporter.write_line(f"random order: rerun it with --random-order-seed={seed}")


def pytest_collection_modifyitems(config, items):
    if random_order_seed(config) is not None:  # pytest-random-order's order, not LONGEST_FIRST's
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in their order


# what a test process holds that its later tests and the commands they start would inherit: the environment (every
# subprocess copies it), the working folder, and huggingface_hub's constants (read from the environment at import)
def process_state() -> dict:
    import huggingface_hub.constants as hub

    return {
        "environment": dict(os.environ),
        "working folder": os.getcwd(),
        "huggingface_hub": {name: value for name, value in vars(hub).items() if name.isupper()},
    }


INITIAL_STATE = process_state()  # this process's, as the test run set it up (above)


@pytest.fixture(autouse=True)
def restored_process_state():
    """Each test ends with its process as the run set it up, whatever the test or its module's fixtures changed.
    Importing vLLM, for one, sets a dozen variables in the environment (LD_LIBRARY_PATH, PATH, TORCHINDUCTOR_*,
    ORT_LIB_PATH, ...) and flips huggingface_hub's HF_XET_HIGH_PERFORMANCE: left there, every command a later test
    starts in the same worker would run under them, and which tests those are depends on how xdist hands out the
    modules."""
    yield
    import huggingface_hub.constants as hub

    running = {name: os.environ[name] for name in ("PYTEST_CURRENT_TEST",) if name in os.environ}  # pytest's own
    os.environ.clear()
    os.environ.update(INITIAL_STATE["environment"] | running)
    os.chdir(INITIAL_STATE["working folder"])
    for name, value in INITIAL_STATE["huggingface_hub"].items():
        setattr(hub, name, value)


@pytest.fixture(params=["mistral", "gemma2"])
def family(request):
    return request.param


def shared_builds() -> dict:
    """What the run builds once for every worker, under a file lock, by the first that asks: fixture name -> the
    function that builds it (or waits for it) in a folder and an environment."""
    from helpers.guides import run_the_docs_pipeline
    from helpers.real_checkpoints import real_checkpoints

    return {"pipeline": run_the_docs_pipeline, "real_checkpoints": real_checkpoints}


def shared_root(config) -> Path:
    """The run's temporary folder, which holds each xdist worker's own (tmp_path_factory's, read as xdist reads it)."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture(scope="session")
def pipeline(request):
    """The README's set-up line, its quickstart and getting started's blocks, run once per test run on a fresh clone
    as a user runs them: its folder (dattn-demo/, converted/, onnx/, video-demo/), each command's stdout and stderr
    kept in commands/. The xdist workers share it; tests copy what they change."""
    return shared_builds()["pipeline"](shared_root(request.config))


@pytest.fixture(scope="session")
def real_checkpoints(request):
    """What DeepSpeed and the Trainer write, trained once per run: the xdist workers share one folder."""
    return shared_builds()["real_checkpoints"](shared_root(request.config))


def pytest_collection_finish(session):
    """The shared builds the collected tests need, started at once in a thread of the first worker, in the order the
    tests first need them: both are commands in processes of their own (the thread only waits), and built before a
    test asks, no worker sits idle on the lock for minutes while another builds. In the environment the run set up,
    not the one a running test has set. A build that fails here is built again by the test that asks for it, which
    then fails with the error."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    builds = shared_builds()
    needed = dict.fromkeys(name for item in session.items for name in item.fixturenames if name in builds)
    if not needed:
        return
    root, environment = shared_root(session.config), dict(INITIAL_STATE["environment"])

    def build_in_order():
        for name in needed:
            with contextlib.suppress(Exception):
                builds[name](root, environment)

    threading.Thread(target=build_in_order, name="shared builds").start()  # not a daemon: the run waits for it
