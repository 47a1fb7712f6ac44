"""The transformers that pyproject.toml allows accepts what the repository passes it: every
``from_pretrained(..., dtype=...)`` (the keyword transformers 4.56 introduced for ``torch_dtype``,
which later releases deprecate) needs ``transformers>=4.56``; an older one would be installable and
fail there."""

from __future__ import annotations

import ast
import os
import re
import tomllib
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DTYPE_KEYWORD_SINCE = Version("4.56")


def _from_pretrained_dtype_keywords() -> dict[str, set[str]]:
    """keyword ("dtype" / "torch_dtype") -> the files whose from_pretrained calls pass it."""
    found: dict[str, set[str]] = {}
    paths = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.endswith(".egg-info") and d != "__pycache__"]
        paths += [Path(top, f) for f in files if f.endswith(".py")]
    for path in paths:
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained":
                for kw in node.keywords:
                    if kw.arg in ("dtype", "torch_dtype"):
                        found.setdefault(kw.arg, set()).add(str(rel))
    return found


def test_the_transformers_lower_bound_accepts_the_dtype_keyword_the_code_passes():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"transformers\b", d)]
    lower = Version(re.search(r">=\s*([\d.]+)", spec).group(1))
    keywords = _from_pretrained_dtype_keywords()
    # the oracle and the benchmarks' peers load with dtype=
    assert {"tests/conftest.py", "benchmarks/hf_peer.py", "benchmarks/gpu_bench.py"} <= keywords["dtype"]
    assert "torch_dtype" not in keywords, keywords["torch_dtype"]  # deprecated since 4.56
    assert lower >= DTYPE_KEYWORD_SINCE, f"pyproject allows {spec}, dtype= needs >= {DTYPE_KEYWORD_SINCE}"
