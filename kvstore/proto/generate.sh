#!/usr/bin/env bash
# Regenerates the gRPC modules. Use grpcio-tools no newer than the oldest grpcio
# the modules must import with (1.84.0, pinned in pyproject's dev extra).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. kvstore/proto/kvstore.proto
