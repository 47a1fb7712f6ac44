"""What the single-op benchmarks (`benchmarks.gemm_peak`, `benchmarks.moe_kernel`,
`benchmarks.attention_op`) share on their command line: comma-separated integers in, the result's table
printed and, where asked, its JSON written."""

from __future__ import annotations

import json
from typing import Callable


def comma_ints(text: str) -> tuple[int, ...]:
    """``"1,2,8"`` -> (1, 2, 8)."""
    return tuple(int(v) for v in text.split(",") if v)


def emit(result: dict, format_table: Callable[[dict], str], json_path: str | None) -> int:
    """Print ``format_table(result)``, write ``result`` to ``json_path`` if given; the exit status (0)."""
    print(format_table(result))
    if json_path:
        with open(json_path, "w") as out:
            json.dump(result, out, indent=1)
    return 0
