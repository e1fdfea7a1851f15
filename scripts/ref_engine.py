"""A reference engine: a tiny Llama (Hugging Face transformers, random weights built in code,
nothing downloaded) whose KV lives in hicache-daemon's pools.

For each prompt it matches the prefix, loads back a host hit, reads the cached KV from the
shared pool into the model's cache, computes only the new tokens, writes their KV into slots it
allocated, inserts the sequence and releases its match. The model is built from the KV shape the
daemon reports, so engine and daemon always agree on layers, KV heads, head dim and dtype.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hicache.client import HiCacheClient

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


@dataclass
class Served:
    logits: torch.Tensor  # [new tokens, vocab]: logits of every token the engine computed
    computed_from: int  # index of the first computed token (= tokens reused from the cache)
    device_hit: int  # tokens found on the device
    host_hit: int  # tokens loaded back from the host
    model_s: float = 0.0  # seconds in the model's forward pass
    daemon_s: float = 0.0  # seconds in daemon calls (match, load back, alloc, insert, release)


class ReferenceEngine:
    def __init__(self, client: HiCacheClient, seed: int = 0):
        self.client = client
        self.pools = client.attach()
        self.model = build_model(client, seed)
        self.page_size = client.config.page_size

    def _cache_from_pool(self, slots: torch.Tensor) -> DynamicCache:
        cache = DynamicCache()
        if not len(slots):
            return cache
        for layer in range(len(self.pools.k_buffer)):
            k = self.pools.k_buffer[layer][slots].permute(1, 0, 2).unsqueeze(0)
            v = self.pools.v_buffer[layer][slots].permute(1, 0, 2).unsqueeze(0)
            cache.update(k.clone(), v.clone(), layer)
        return cache

    def _write_new_kv(self, cache: DynamicCache, start: int, slots: torch.Tensor) -> None:
        for layer, entry in enumerate(cache.layers):
            self.pools.k_buffer[layer][slots] = entry.keys[0, :, start:].permute(1, 0, 2)
            self.pools.v_buffer[layer][slots] = entry.values[0, :, start:].permute(1, 0, 2)

    @torch.no_grad()
    def serve(self, tokens: np.ndarray) -> Served:
        hc, tokens = self.client, np.asarray(tokens, dtype=np.int32)
        t0 = time.perf_counter()
        m = hc.match_prefix(tokens)
        loaded = hc.load_back(m)
        prefix = m.device_indices if loaded is None else torch.cat([m.device_indices, loaded])
        try:
            reuse = len(prefix)
            if reuse == len(tokens):  # a full hit still computes its last page for logits
                reuse -= self.page_size
            t1 = time.perf_counter()
            cache = self._cache_from_pool(prefix[:reuse])
            ids = torch.from_numpy(tokens[reuse:].astype(np.int64)).unsqueeze(0)
            positions = torch.arange(reuse, len(tokens)).unsqueeze(0)
            out = self.model(ids, cache=cache, position_ids=positions, use_cache=True)
            t2 = time.perf_counter()
            new = hc.alloc(len(tokens) - reuse)
            t3 = time.perf_counter()
            self._write_new_kv(cache, reuse, new)
            t4 = time.perf_counter()
            hc.insert(tokens, torch.cat([prefix[:reuse], new]))
        finally:
            hc.release(m)
        t5 = time.perf_counter()
        host = 0 if loaded is None else len(loaded)
        # reading and writing the shared pool is the engine's own work, not the daemon's
        daemon = (t1 - t0) + (t3 - t2) + (t5 - t4)
        return Served(out.logits[0], reuse, m.device_hit_length, host, t2 - t1, daemon)

    @torch.no_grad()
    def recompute(self, tokens: np.ndarray) -> torch.Tensor:
        """Logits of every token from scratch (the oracle)."""
        ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).unsqueeze(0)
        return self.model(ids).logits[0]
