"""Names SGLang's linear-attention layers import on the CPU; this stand-in has none of them."""

from __future__ import annotations


def _not_here(name: str):  # noqa: ANN202
    def refuse(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"{name}: linear attention is not in this CPU stand-in")

    refuse.__name__ = name
    return refuse


causal_conv1d_fn_cpu = _not_here("causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = _not_here("causal_conv1d_update_cpu")
chunk_gated_delta_rule_cpu = _not_here("chunk_gated_delta_rule_cpu")
