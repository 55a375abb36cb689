from ..drafter_service.conftest import tiny_mtp_model  # noqa: F401  (shared fixture)
