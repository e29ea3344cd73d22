"""Sampling and verification math for lossless speculative decoding (see sampling.py, verify.py)."""

from .sampling import (
    filter_logits,
    ref_filter_logits,
    ref_saguaro_probs,
    ref_sample_from_probs,
    saguaro_probs,
    sample_from_probs,
)
from .verify import (
    VerifyResult,
    ref_verify_greedy,
    ref_verify_rejection,
    verify_greedy,
    verify_rejection,
    verify_tree_greedy,
    verify_tree_rejection,
)

__all__ = [
    "VerifyResult",
    "filter_logits",
    "ref_filter_logits",
    "ref_saguaro_probs",
    "ref_sample_from_probs",
    "ref_verify_greedy",
    "ref_verify_rejection",
    "saguaro_probs",
    "sample_from_probs",
    "verify_greedy",
    "verify_rejection",
    "verify_tree_greedy",
    "verify_tree_rejection",
]
