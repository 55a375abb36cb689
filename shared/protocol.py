"""The wire protocol: generated message modules and the protocol version both sides speak.

The `tandem.v1` modules are generated from protos/tandem/v1/*.proto when the package is
installed (setup.py); importing this module fails with a clear message when they are not.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1

try:
    from tandem.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
except ImportError as error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "the generated protocol modules (tandem.v1.*_pb2) are missing; "
        "install the package (`pip install -e .`), which generates them from protos/"
    ) from error

__all__ = [
    "PROTOCOL_VERSION",
    "common_pb2",
    "drafter_pb2",
    "drafter_pb2_grpc",
    "verifier_pb2",
    "verifier_pb2_grpc",
    "service_names",
]


def service_names() -> list[str]:
    """Fully-qualified names of the gRPC services (for health checking and reflection)."""
    return [
        verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name,
        drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name,
    ]
