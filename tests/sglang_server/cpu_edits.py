"""A test fixture, never part of hicache: two small edits that let SGLang 0.5.23's hierarchical
cache run with ``--device cpu`` (run with the SGLang venv's python by scripts/setup_sglang.sh).

1. ``mem_cache/pool_host/base.py``: on the CPU engine the host pool is not pinned (pinning calls
   ``torch.cuda.cudart()``, which fails without an NVIDIA driver).
2. ``mem_cache/pool_host/mha.py``: the ``direct`` io backend's three copies are bound on the CPU
   engine too (0.5.23 binds them on CUDA, HIP and XPU only), from the stand-in's
   ``sgl_kernel.kvcacheio``.

Idempotent: an edit already made is left alone; text that is not where 0.5.23 has it stops
with an error naming the file (another SGLang version).
"""

from __future__ import annotations

import sys
from pathlib import Path

MARK = "# hicache tests: CPU engine"
EDITS = {
    "base.py": [
        (
            "from sglang.srt.utils import is_cuda, is_hip\n",
            "from sglang.srt.utils import is_cpu, is_cuda, is_hip\n",
        ),
        (
            "        self.pin_memory = pin_memory\n",
            f"        {MARK}: its device pool is host memory, nothing to pin for\n"
            "        self.pin_memory = pin_memory and not is_cpu()\n",
        ),
    ],
    "mha.py": [
        (
            "from sglang.srt.utils import is_cuda, is_hip, is_mps, is_npu, is_xpu\n",
            "from sglang.srt.utils import is_cpu, is_cuda, is_hip, is_mps, is_npu, is_xpu\n",
        ),
        (
            "if _is_npu:\n    from sgl_kernel_npu.kvcacheio import",
            f"elif is_cpu():  {MARK}: the direct io backend's copies\n"
            "    from sgl_kernel.kvcacheio import (\n"
            "        transfer_kv_all_layer_direct_lf_pf,\n"
            "        transfer_kv_direct,\n"
            "        transfer_kv_per_layer_direct_pf_lf,\n"
            "    )\n"
            "if _is_npu:\n    from sgl_kernel_npu.kvcacheio import",
        ),
    ],
}


def apply(pool_host: Path) -> list[str]:
    """Make the edits in SGLang's ``srt/mem_cache/pool_host`` folder; the files changed."""
    changed = []
    for name, pairs in EDITS.items():
        path = pool_host / name
        text = path.read_text()
        if MARK in text:
            continue
        for old, new in pairs:
            if text.count(old) != 1:
                raise SystemExit(f"{path}: not SGLang 0.5.23's text (looked for {old!r})")
            text = text.replace(old, new)
        path.write_text(text)
        changed.append(name)
    return changed


if __name__ == "__main__":
    import sglang

    folder = Path(sglang.__file__).parent / "srt" / "mem_cache" / "pool_host"
    done = apply(folder)
    print(f"SGLang CPU edits: {', '.join(done) or 'already made'} in {folder}", file=sys.stderr)
