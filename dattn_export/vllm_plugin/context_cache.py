"""Contexts computed once per server: a request whose image or video was seen before skips the towers and the
context stream, and its cross-attention caches are filled from this rank's copy of the context K/V of every layer.

In D-Attn the context never depends on the question, so the K/V that the first request on a video wrote into its
cross-attention caches are exactly those every later request on it needs. vLLM's encoder-decoder path shares nothing
between requests (its encoder cache and prefix caching are off there), so the plugin keeps them itself:
  * the processor gives each image or video a `digest` of its content (`media_digest`; a served video file's is of
    its bytes, `media.DAttnVideoLoader`; an item its request names, vLLM's `multi_modal_uuids`, its name's:
    `named_digest`), which vLLM's processor cache keeps with the item's other fields;
  * `embed_multimodal` runs the towers only for digests not cached here, and hands over a marker for the others;
  * the model's forward runs the context stream once per distinct new context of the step, stores each one's K/V
    (this rank's heads: tensor parallel ranks each cache their own), and writes cached ones into the step's
    cross-attention caches as vLLM writes fresh ones. A request reads the cache only in its first step, after
    which its own cross-attention caches hold the context, so eviction never touches a request in flight.
Least recently used contexts leave first once the cache passes its size (`--hf-overrides '{"context_cache_gib":
N}'`, 0: off); a context larger than the whole cache is not kept. Every rank sees the same keys in the same order
and holds entries of the same size, so all ranks hit and miss together, as the towers' and the context stream's
tensor-parallel collectives need.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from blake3 import blake3  # vLLM's own dependency (it hashes multimodal items with it)

from . import DEFAULT_CONTEXT_CACHE_GIB

DIGEST_BYTES = 16


def context_cache_bytes(config) -> int:
    """The context cache's size per rank (`--hf-overrides '{"context_cache_gib": N}'`), in bytes."""
    return int(float(getattr(config, "context_cache_gib", DEFAULT_CONTEXT_CACHE_GIB)) * 2**30)


def media_digest(*parts: np.ndarray | bytes | None) -> torch.Tensor:
    """A content hash of an item's media (pixels, samples, each array's shape and dtype), as (DIGEST_BYTES,) uint8."""
    digest = blake3(max_threads=blake3.AUTO)  # the same digest, computed on every core
    for part in parts:
        if isinstance(part, np.ndarray):
            part = np.ascontiguousarray(part)
            digest.update(f"{part.dtype}{part.shape}".encode())
            part = memoryview(part).cast("B")
        digest.update(b"none" if part is None else part)
        digest.update(b"|")
    return torch.frombuffer(bytearray(digest.digest(length=DIGEST_BYTES)), dtype=torch.uint8)


def named_digest(uuid: str) -> torch.Tensor:
    """The digest of an item its request names (vLLM's `multi_modal_uuids`, which vLLM's own caches take in place of
    the item's hash: one name, one medium), with no hash of its media."""
    return media_digest(b"multi_modal_uuid", uuid.encode())


def digest_keys(digests: torch.Tensor | Iterable[torch.Tensor]) -> list[bytes]:
    return [bytes(d.tolist()) for d in digests]


@dataclass
class CachedContext:
    """One context on this rank: each token's segment and, per layer, its K and V (tokens, KV heads x head_dim)."""

    segment: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.segment.nbytes + sum(k.nbytes + v.nbytes for k, v in self.layers)


@dataclass
class Context:
    """A step's request context: fresh (its stream's tokens (tokens, hidden) to run) or `cached`."""

    key: bytes | None
    segment: torch.Tensor
    stream: torch.Tensor | None = None
    cached: CachedContext | None = None

    @property
    def name(self) -> bytes | int:
        """What makes two of a step's contexts one: the digest, else the context itself."""
        return id(self) if self.key is None else self.key


class ByteBoundCache:
    """Values by key, the least recently used out first past `limit_bytes`; a value larger than the whole cache is
    not kept. `hits` / `misses` count lookups, `evictions` the values that left to make room. Lookups and stores
    may come from several threads (vLLM loads a server's media on a thread pool)."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.entries: OrderedDict[bytes, tuple[object, int]] = OrderedDict()
        self.nbytes = self.peak_bytes = self.hits = self.misses = self.evictions = 0
        self.lock = threading.Lock()

    def get(self, key: bytes):
        with self.lock:
            found = self.entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self.hits += 1
            self.entries.move_to_end(key)
            return found[0]

    def fits(self, key: bytes, size: int) -> bool:
        return key not in self.entries and size <= self.limit_bytes

    def put(self, key: bytes, value, size: int) -> None:
        with self.lock:
            if not self.fits(key, size):
                return
            while self.nbytes + size > self.limit_bytes:
                self.nbytes -= self.entries.popitem(last=False)[1][1]
                self.evictions += 1
            self.entries[key] = (value, size)
            self.nbytes += size
            self.peak_bytes = max(self.peak_bytes, self.nbytes)


class ContextCache(ByteBoundCache):
    """Contexts (`CachedContext`) by digest."""

    def __init__(self, limit_bytes: int):
        super().__init__(limit_bytes)
        # embed_multimodal's outputs, by id, until forward reads them: (the output, weakly, so that one vLLM drops
        # frees its memory; its key; its cached context, held until then even if evicted meanwhile)
        self.handed: dict[int, tuple[weakref.ref, bytes | None, CachedContext | None]] = {}

    def store(self, key: bytes, entry: CachedContext) -> None:
        """Keep a copy of `entry` (the step's tensors hold the whole batch's rows)."""
        if self.fits(key, size := entry.nbytes):
            layers = [(k.clone(), v.clone()) for k, v in entry.layers]
            self.put(key, CachedContext(entry.segment.clone(), layers), size)

    def stats(self) -> dict[str, int]:
        return {
            "contexts": len(self.entries),
            "bytes": self.nbytes,  # what the kept tensors hold
            "peak_bytes": self.peak_bytes,
            "limit_bytes": self.limit_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }

    def hand_over(self, keys: list[bytes | None], compute) -> list[torch.Tensor]:
        """embed_multimodal's outputs for items with these keys: `compute(indices)` -> the streams (tokens, hidden +
        1, the last column each token's segment) of the items not cached, each distinct one once; a cached item's
        output is a (1, 1) marker. Each output is remembered with its key for `contexts`."""
        cached = [None if key is None else self.get(key) for key in keys]
        names = [i if key is None else key for i, key in enumerate(keys)]  # an item without a key is its own
        first: dict[bytes | int, int] = {}  # an item not cached, by its name: the first item with that name
        for i, entry in enumerate(cached):
            if entry is None:
                first.setdefault(names[i], i)
        computed = dict(zip(first.values(), compute(list(first.values())) if first else [], strict=True))
        streams = {i: computed[first[names[i]]] for i, entry in enumerate(cached) if entry is None}
        self.handed = {number: item for number, item in self.handed.items() if item[0]() is not None}
        outputs = []
        for i, (key, entry) in enumerate(zip(keys, cached)):
            output = streams[i] if entry is None else entry.segment.new_zeros(1, 1)
            self.handed[id(output)] = (weakref.ref(output), key, entry)
            outputs.append(output)
        return outputs

    def contexts(self, outputs: list[torch.Tensor]) -> ContextBatch:
        """The step's contexts from embed_multimodal's outputs, in the order of the requests' cross-attention
        caches."""
        contexts = []
        for output in outputs:
            reference, key, entry = self.handed.get(id(output), (None, None, None))
            if reference is None or reference() is not output:  # not handed over by `hand_over`: computed, no key
                key, entry = None, None
            if entry is None:
                contexts.append(Context(key, output[:, -1].round().long(), stream=output[:, :-1]))
            else:
                contexts.append(Context(key, entry.segment, cached=entry))
        self.handed.clear()
        return ContextBatch(contexts, self)


class ContextBatch:
    """A step's contexts: the fresh ones' streams run through the layers once per distinct key (two requests on one
    new video in one step compute it once), the cached ones' K/V read from the cache."""

    def __init__(self, contexts: list[Context], cache: ContextCache):
        self.contexts, self.cache = contexts, cache
        self.fresh: dict[bytes | int, Context] = {}
        for context in contexts:
            if context.cached is None:
                self.fresh.setdefault(context.name, context)
        self.built = {name: CachedContext(context.segment) for name, context in self.fresh.items()}
        self.segment = torch.cat([context.segment for context in contexts])

    @property
    def stream(self) -> torch.Tensor | None:
        """The fresh contexts' tokens, one after another (None: every context is cached)."""
        return torch.cat([context.stream for context in self.fresh.values()]) if self.fresh else None

    def layer_kv(self, layer: int, k: torch.Tensor | None, v: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """A layer's K and V over every context, from the fresh contexts' (`k`, `v`: their tokens one after
        another; None when there are none) and the cached ones'."""
        if self.fresh:
            sizes = [len(context.segment) for context in self.fresh.values()]
            for entry, piece in zip(self.built.values(), zip(k.split(sizes), v.split(sizes)), strict=True):
                entry.layers.append(piece)
        keys, values = zip(*((context.cached or self.built[context.name]).layers[layer] for context in self.contexts))
        if len(keys) == 1:  # one request's context (the usual step): as cached, not copied
            return keys[0], values[0]
        return torch.cat(keys), torch.cat(values)

    def finish(self) -> None:
        """Keep the fresh contexts that have a key."""
        for name, entry in self.built.items():
            if isinstance(name, bytes):
                self.cache.store(name, entry)
