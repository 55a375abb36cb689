"""Speculation that never costs (DESIGN §9): per request, whether its next round waits for the
drafter (`request.Governor`), judged against what the server's rounds under the same load
realised (`ledger.Ledgers`)."""

from verifier_service.governor.ledger import CostWindow, Ledger, Ledgers, Load
from verifier_service.governor.request import Governor, Phase
from verifier_service.governor.settings import GovernorSettings

__all__ = ["CostWindow", "Governor", "GovernorSettings", "Ledger", "Ledgers", "Load", "Phase"]
