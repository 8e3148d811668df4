"""Generated gRPC stubs for mmserve.v1 (do not edit; `make proto` regenerates them)."""

from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
