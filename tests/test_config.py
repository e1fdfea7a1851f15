import pytest

from hicache import HiCacheConfig, HostLayout, KVFormat, WritePolicyName

BASE = dict(num_layers=2, num_kv_heads=2, head_dim=8)


def test_defaults_resolve_to_enums_and_host_ratio():
    cfg = HiCacheConfig(**BASE, page_size=4, device_tokens=64)
    assert cfg.kv_format is KVFormat.MHA and cfg.host_layout is HostLayout.LAYER_FIRST
    assert cfg.write_policy is WritePolicyName.WRITE_THROUGH
    assert cfg.host_capacity_tokens == 128 and cfg.host_enabled
    assert cfg.token_bytes == 2 * 2 * 2 * 8 * 2  # K+V, layers, heads, dim, fp16


def test_config_is_frozen_and_replace_revalidates():
    cfg = HiCacheConfig(**BASE)
    with pytest.raises(AttributeError):
        cfg.page_size = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="page_size"):
        cfg.replace(page_size=0)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"dtype": "int8"}, "dtype"),
        ({"kv_format": "gqa"}, "kv_format"),
        ({"device": "tpu"}, "device"),
        ({"page_size": 3, "device_tokens": 64}, "device_tokens"),
        ({"host_ratio": 1.0}, "host_ratio"),
        ({"host_tokens": 64, "device_tokens": 64}, "host_tokens"),
        ({"host_tokens": 100, "page_size": 16, "device_tokens": 64}, "host_tokens"),
        ({"host_layout": "head_first"}, "host_layout"),
        ({"write_policy": "write_around"}, "write_policy"),
        ({"eviction_policy": "random"}, "eviction_policy"),
        ({"write_through_threshold": 0}, "write_through_threshold"),
        ({"load_back_threshold": -1}, "load_back_threshold"),
        ({"device_tokens": 1.5}, "device_tokens"),
        ({"kv_lora_rank": 4}, "kv_lora_rank"),
    ],
)
def test_bad_values_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        HiCacheConfig(**{**BASE, **change})


def test_mla_shape_and_host_off():
    cfg = HiCacheConfig(
        num_layers=3, kv_format="mla", kv_lora_rank=6, qk_rope_head_dim=2, host_tokens=0
    )
    assert cfg.num_kv == 1 and cfg.head_shape == (1, 8) and not cfg.host_enabled
    with pytest.raises(ValueError, match="kv_lora_rank"):
        HiCacheConfig(num_layers=3, kv_format="mla")
