"""Token estimation: a fast estimate for every request, an exact count only near a threshold."""

from kvgate.estimate.estimator import Estimator, PromptCosts, TokenEstimate

__all__ = ["Estimator", "PromptCosts", "TokenEstimate"]
