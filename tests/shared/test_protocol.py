"""The generated protocol modules exist, round-trip, and tolerate unknown fields."""

import subprocess
import sys

import pytest

from shared.protocol import PROTOCOL_VERSION, common_pb2, drafter_pb2, drafter_pb2_grpc, service_names, verifier_pb2


def test_services_are_generated():
    assert service_names() == ["tandem.v1.Verifier", "tandem.v1.Drafter"]
    assert hasattr(drafter_pb2_grpc, "DrafterServicer")
    methods = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].methods_by_name
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    draft = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].methods_by_name["Draft"]
    assert draft.server_streaming and draft.client_streaming


def test_chain_round_trip():
    chain = drafter_pb2.DraftChain(
        round_id=7,
        base_length=120,
        source=common_pb2.DRAFT_SOURCE_MTP,
        token_ids=[5, 9],
        q_rows=[common_pb2.SparseRow(token_ids=[5, 6], probs=[0.75, 0.25]), common_pb2.SparseRow(token_ids=[9], probs=[1.0])],
        confidences=[0.75, 1.0],
    )
    message = drafter_pb2.DraftDown(protocol_version=PROTOCOL_VERSION, chain=chain)
    decoded = drafter_pb2.DraftDown.FromString(message.SerializeToString())
    assert decoded == message
    assert list(decoded.chain.q_rows[0].probs) == [0.75, 0.25]


def test_unknown_fields_are_ignored():
    newer = verifier_pb2.GenerateRequest(protocol_version=PROTOCOL_VERSION, max_new_tokens=3).SerializeToString()
    newer += bytes([0xF8, 0x3E, 0x01])  # field 999, varint 1: a field this version does not know
    parsed = verifier_pb2.GenerateRequest.FromString(newer)
    assert parsed.max_new_tokens == 3


def test_cli_prints_the_protocol():
    out = subprocess.run([sys.executable, "-m", "shared.cli", "protocol"], capture_output=True, text=True, check=True)
    assert "tandem protocol v1" in out.stdout
    assert "tandem.v1.Drafter" in out.stdout


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "transposed", "requires_grad"])
def test_hidden_rows_round_trip_as_bf16(kind):
    """encode_hidden sends rows as bf16 bytes whatever their dtype, layout or autograd state;
    decode_hidden gives back the bf16 rows."""
    import torch

    from shared.protocol import decode_hidden, encode_hidden

    rows = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    if kind == "bfloat16":
        rows = rows.to(torch.bfloat16)
    elif kind == "transposed":
        rows = torch.randn(6, 5, generator=torch.Generator().manual_seed(3)).t()
    elif kind == "requires_grad":
        rows = rows.requires_grad_()
    message = encode_hidden(rows)
    assert (message.num_rows, message.hidden_size) == (5, 6)
    assert torch.equal(decode_hidden(message), rows.detach().to(torch.bfloat16))
