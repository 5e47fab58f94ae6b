"""`retrieve --backend vllm --ray ADDRESS`: a benchmark's videos spread over vLLM replicas on a Ray cluster, for a
library that outgrows one engine. Each replica is a Ray actor holding one engine (`engine.Engine`, tensor
parallel within it: a GPU a rank, or on CPU nodes a core a rank); Ray's `ActorPool` hands each free replica the next
video, whose queries it answers from one context as on one machine. Every node must run this package's environment
(`ray start` from the same venv) and see the videos at the same path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .engine import Engine
from .videos import Answered, Video


class Replica:
    """An engine in a Ray actor: a video's answers at a time."""

    def __init__(self, folder: str, frames: int, prompt_tokens: int, max_new_tokens: int, tensor_parallel: int,
                 verbose: bool):  # fmt: skip
        self.engine = Engine(Path(folder), frames, prompt_tokens, max_new_tokens, tensor_parallel, verbose)

    def answer(self, video: Video) -> list[Answered]:
        return list(self.engine.answers([video]))

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        self.engine.close()


class RayReplicas:
    """`replicas` engines on the Ray cluster at `address`, each an actor of `Replica` with `tensor_parallel` ranks
    (GPUs where the cluster has them, else cores), handed videos by Ray's ActorPool as they free up."""

    def __init__(self, folder: Path, frames: int, prompt_tokens: int, max_new_tokens: int, tensor_parallel: int,
                 address: str, replicas: int, verbose: bool = False):  # fmt: skip
        import ray

        from ...errors import EnvironmentFailure

        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            reason = " ".join(str(e).split())[:200]
            raise EnvironmentFailure(address, f"no Ray cluster answers there ({reason})") from None
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        actor = ray.remote(**{"num_gpus" if gpus else "num_cpus": tensor_parallel})(Replica)
        self.actors = [actor.remote(str(Path(folder).resolve()), frames, prompt_tokens, max_new_tokens,
                                    tensor_parallel, verbose) for _ in range(replicas)]  # fmt: skip
        self.nodes = set(ray.get([replica.node.remote() for replica in self.actors]))
        self.where = f"{replicas} vLLM replica(s) of tensor parallel {tensor_parallel} on {len(self.nodes)} Ray node(s)"

    def __call__(self, todo: list[Video], seconds) -> Iterator[Answered]:
        import ray
        from ray.util import ActorPool

        try:
            pool = ActorPool(self.actors)
            for answers in pool.map_unordered(lambda replica, video: replica.answer.remote(video), todo):
                yield from answers
            ray.get([replica.close.remote() for replica in self.actors])
        finally:
            for replica in self.actors:
                ray.kill(replica)
            ray.shutdown()
