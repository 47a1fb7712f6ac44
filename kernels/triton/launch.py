"""Where every Triton launch of the kernels goes through (``_launch``), with the warm-up's hooks, and
whether the kernels run under the interpreter (``TRITON_INTERPRET=1``, read at import)."""

from __future__ import annotations

import os

import triton

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Launch hooks (``kernels.triton.warmup``): each is called as ``hook(kernel, grid, args, constexprs)``
# before a launch and may answer False to skip the launch (a dry run that only records).
LAUNCH_HOOKS: list = []


def _launch(kernel, grid: tuple, args: tuple, constexprs: dict) -> None:
    run = True
    for hook in LAUNCH_HOOKS:
        if hook(kernel, grid, args, constexprs) is False:
            run = False
    if run:
        kernel[grid](*args, **constexprs)


def _p2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(max(1, int(n))))
