#!/usr/bin/env bash
# Regenerate the committed gRPC stubs of api/kvserve.proto:
#   api/kvserve_pb2.py, api/kvserve_pb2.pyi, api/kvserve_pb2_grpc.py
#
# Run from anywhere: `api/gen_grpc.sh` (uses $PYTHON, else the repo's .venv, else python3; needs
# grpcio-tools). The proto is compiled with the repository root as the include path, so the
# generated service module imports its messages as `from api import kvserve_pb2` and works both from
# the repo root and from an installed kvserve package.
#
# The generated message module checks the protobuf runtime at import: it needs a runtime of the same
# or a newer version than the protoc bundled with grpcio-tools (grpcio-tools 1.85 bundles protoc 35.1,
# so protobuf >= 7.35.1). Regenerating with an older grpcio-tools lowers that floor.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
"$PYTHON" -m grpc_tools.protoc -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  api/kvserve.proto
# the import the brief of api/ asks for; protoc already writes it this way, the check keeps it so
grep -q '^from api import kvserve_pb2 as ' api/kvserve_pb2_grpc.py \
  || { echo "gen_grpc.sh: unexpected import in api/kvserve_pb2_grpc.py" >&2; exit 1; }
echo "generated api/kvserve_pb2.py api/kvserve_pb2.pyi api/kvserve_pb2_grpc.py with $("$PYTHON" -m grpc_tools.protoc --version)"
