"""A reference engine: a tiny Llama (Hugging Face transformers, random weights built in code,
nothing downloaded) whose KV lives in hicache-daemon's pools.

For each prompt it matches the prefix, starts loading a host hit back, computes only the new
tokens, writes their KV into slots it allocated, inserts the sequence and releases its match.
Cached KV is read from the shared pool layer by layer as the model reaches each layer, after
``wait_layer`` says that layer of the load is on the device: later layers keep loading while
earlier ones compute. The model is built from the KV shape the
daemon reports, so engine and daemon always agree on layers, KV heads, head dim and dtype.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hicache.client import HiCacheClient, LoadTicket

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# transformers 5.2x renamed forward's past_key_values to cache; vLLM pins an older 5.1x
CACHE_KWARG = (
    "past_key_values"
    if "past_key_values" in inspect.signature(LlamaForCausalLM.forward).parameters
    else "cache"
)


def build_model(client: HiCacheClient, seed: int = 0, vocab: int = 512) -> LlamaForCausalLM:
    """The same random model in every process for the same seed and daemon config."""
    cfg = client.config
    heads = 2 * cfg.num_kv_heads  # grouped-query attention: two query heads per KV head
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=heads * cfg.head_dim,
        intermediate_size=4 * cfg.head_dim,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=8192,
    )
    config._attn_implementation = "eager"  # deterministic, the same kernel with or without cache
    return LlamaForCausalLM(config).to(DTYPES[cfg.dtype]).eval()


class PoolPrefixCache(DynamicCache):
    """A DynamicCache whose cached prefix is read from the pool one layer at a time, when the
    model first reaches that layer. Layer 0 is read at once: masks and positions take the
    prefix length from it before any layer runs."""

    def __init__(self, fetch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self._fetch = fetch  # layer -> (k, v) of the prefix, [1, heads, tokens, dim]
        self._filled: set[int] = set()
        self._fill(0)

    def _fill(self, layer: int) -> None:
        if layer not in self._filled:
            self._filled.add(layer)
            super().update(*self._fetch(layer), layer)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # noqa: ANN001
        self._fill(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@dataclass
class Served:
    logits: torch.Tensor  # [new tokens, vocab]: logits of every token the engine computed
    computed_from: int  # index of the first computed token (= tokens reused from the cache)
    device_hit: int  # tokens found on the device
    host_hit: int  # tokens loaded back from the host
    model_s: float = 0.0  # seconds in the model's forward pass
    daemon_s: float = 0.0  # seconds in daemon calls (match, load back, alloc, insert, release)
    load_wait_s: float = 0.0  # seconds the model waited for layers of a load (in model_s)


class ReferenceEngine:
    def __init__(self, client: HiCacheClient, seed: int = 0):
        self.client = client
        self.pools = client.attach()
        self.device = self.pools.device.buffer.device  # the model runs where the pool is
        self.model = build_model(client, seed).to(self.device)
        self.page_size = client.config.page_size

    def _cache_from_pool(
        self, slots: torch.Tensor, load: LoadTicket | None, waited: list[float]
    ) -> DynamicCache:
        if not len(slots):
            return DynamicCache()

        def fetch(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            if load is not None:
                t0 = time.perf_counter()
                self.client.wait_layer(load, layer)
                waited[0] += time.perf_counter() - t0
            at = slots.to(self.device)
            k = self.pools.k_buffer[layer][at].permute(1, 0, 2).unsqueeze(0)
            v = self.pools.v_buffer[layer][at].permute(1, 0, 2).unsqueeze(0)
            return k, v  # fancy indexing copied them: the pool may change afterwards

        return PoolPrefixCache(fetch)

    def _write_new_kv(self, cache: DynamicCache, start: int, slots: torch.Tensor) -> None:
        at = slots.to(self.device)
        for layer, entry in enumerate(cache.layers):
            self.pools.k_buffer[layer][at] = entry.keys[0, :, start:].permute(1, 0, 2)
            self.pools.v_buffer[layer][at] = entry.values[0, :, start:].permute(1, 0, 2)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the KV is complete before the insert publishes it

    @torch.no_grad()
    def serve(self, tokens: np.ndarray) -> Served:
        hc, tokens = self.client, np.asarray(tokens, dtype=np.int32)
        t0 = time.perf_counter()
        m = hc.match_prefix(tokens)
        load = hc.load_back_async(m)  # returns at once; layers are awaited in the forward pass
        prefix = m.device_indices if load is None else torch.cat([m.device_indices, load.slots])
        try:
            reuse = len(prefix)
            if reuse == len(tokens):  # a full hit still computes its last page for logits
                reuse -= self.page_size
            t1 = time.perf_counter()
            waited = [0.0]
            cache = self._cache_from_pool(prefix[:reuse], load, waited)
            ids = torch.from_numpy(tokens[reuse:].astype(np.int64)).unsqueeze(0).to(self.device)
            positions = torch.arange(reuse, len(tokens), device=self.device).unsqueeze(0)
            kv = {CACHE_KWARG: cache}  # (its name differs between transformers versions)
            out = self.model(ids, position_ids=positions, use_cache=True, **kv)
            if load is not None:
                hc.wait_load(load)  # even a layer the model did not read: before insert
            t2 = time.perf_counter()
            new = hc.alloc(len(tokens) - reuse)
            t3 = time.perf_counter()
            self._write_new_kv(cache, reuse, new)
            t4 = time.perf_counter()
            hc.insert(tokens, torch.cat([prefix[:reuse], new]))
        finally:
            hc.release(m)
        t5 = time.perf_counter()
        host = 0 if load is None else len(load.slots)
        # reading and writing the shared pool is the engine's own work, not the daemon's
        daemon = (t1 - t0) + (t3 - t2) + (t5 - t4)
        return Served(out.logits[0], reuse, m.device_hit_length, host, t2 - t1, daemon, waited[0])

    @torch.no_grad()
    def recompute(self, tokens: np.ndarray) -> torch.Tensor:
        """Logits of every token from scratch (the oracle)."""
        ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).unsqueeze(0)
        return self.model(ids.to(self.device)).logits[0]
