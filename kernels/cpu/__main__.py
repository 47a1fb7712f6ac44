"""``python -m kernels.cpu``: build the compiled CPU kernels now (``make install`` runs it)."""

from __future__ import annotations

import sys
import time

from kernels.cpu.build import build


def main() -> int:
    start = time.perf_counter()
    try:
        library = build(verbose="-v" in sys.argv)
    except Exception as exc:
        print(f"kvserve CPU kernels not built ({exc}); the plain-torch kernels will run", file=sys.stderr)
        return 0
    print(f"kvserve CPU kernels: {library} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
