"""``python -m kernels.cpu``: build the compiled CPU kernels now (``make install`` runs it).
``python -m kernels.cpu --compile DIR``: the compiler step itself, which ``build()`` runs in a child
process (see ``kernels.cpu.build``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kernels.cpu.build import BuildError, build, compile_here


def main() -> int:
    verbose = "-v" in sys.argv
    if len(sys.argv) >= 3 and sys.argv[1] == "--compile":
        print(compile_here(Path(sys.argv[2]), verbose), flush=True)
        return 0
    start = time.perf_counter()
    try:
        library = build(verbose=verbose)
    except BuildError as exc:
        print(f"kvserve CPU kernels not built ({exc}); the plain-torch kernels will run", file=sys.stderr)
        return 0
    print(f"kvserve CPU kernels: {library} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
