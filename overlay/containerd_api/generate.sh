#!/bin/sh
# Regenerate the Python stubs of these protos (run from the repository root, with grpcio-tools installed).
set -e
"${PYTHON:-python3}" -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. overlay/containerd_api/*.proto
rm -f overlay/containerd_api/types_pb2_grpc.py  # types.proto has no service
