"""TLS/mTLS between the services and for clients, and bearer-token auth on Generate."""

import grpc
import pytest

from drafter_service.server import DrafterServer
from drafter_service.settings import DrafterSettings
from shared.client import AsyncVerifierClient, GenerationConfig, VerifierError
from shared.security import channel_credentials, make_test_pki
from verifier_service.server import VerifierServer
from verifier_service.settings import VerifierSettings


TOKEN = "s3cret-token"


@pytest.fixture
def pki(tmp_path):
    return make_test_pki(tmp_path)


async def start_pair(model, pki, drafter_client_cert):
    drafter = DrafterServer(DrafterSettings(
        port=0, planner="mtp", tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]),
        tls_client_ca=str(pki["ca"])), model=model)
    dport = await drafter.start()
    await drafter.wait_loaded()
    verifier = VerifierServer(VerifierSettings(
        port=0, drafter=f"localhost:{dport}", drafter_deadline_ms=2000.0,
        drafter_tls_ca=str(pki["ca"]), drafter_tls_cert=str(pki[f"{drafter_client_cert}_cert"]),
        drafter_tls_key=str(pki[f"{drafter_client_cert}_key"]),
        tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]), auth_token=TOKEN), model=model)
    vport = await verifier.start()
    await verifier.wait_loaded()
    return drafter, verifier, vport


async def test_mutual_tls_between_services_and_token_auth(tiny_mtp_model, pki):
    drafter, verifier, port = await start_pair(tiny_mtp_model, pki, "client")
    credentials = channel_credentials(str(pki["ca"]))
    config = GenerationConfig(max_new_tokens=8, temperature=0.8, seed=1)
    try:
        async with AsyncVerifierClient(f"localhost:{port}", credentials=credentials, token=TOKEN) as client:
            result = await client.generate([3, 14, 15, 92, 65], config)
        assert len(result.token_ids) == 8 and result.stats["proposed"] > 0 and result.stats["drafter_faults"] == 0
        for token, message in ((None, "missing bearer token"), ("wrong", "invalid bearer token")):
            async with AsyncVerifierClient(f"localhost:{port}", credentials=credentials, token=token) as client:
                with pytest.raises(VerifierError) as error:
                    await client.generate([1, 2, 3], config)
            assert error.value.code == grpc.StatusCode.UNAUTHENTICATED and message in error.value.message
        async with AsyncVerifierClient(f"localhost:{port}", token=TOKEN) as client:  # plaintext to a TLS server
            with pytest.raises(VerifierError) as error:
                await client.generate([1, 2, 3], config)
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        await verifier.stop(0)
        await drafter.stop(0)


async def test_drafter_refuses_a_client_certificate_from_another_ca(tiny_mtp_model, pki):
    drafter, verifier, port = await start_pair(tiny_mtp_model, pki, "other_client")
    try:
        async with AsyncVerifierClient(f"localhost:{port}", credentials=channel_credentials(str(pki["ca"])),
                                       token=TOKEN) as client:
            result = await client.generate([3, 14, 15, 92, 65], GenerationConfig(max_new_tokens=4))
        # the handshake with the drafter fails: the request completes without drafts
        assert len(result.token_ids) == 4 and result.stats["proposed"] == 0
    finally:
        await verifier.stop(0)
        await drafter.stop(0)
