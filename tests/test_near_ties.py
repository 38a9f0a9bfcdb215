"""checks.conformance.greedy_divergences_beyond_ties: where an engine candidate's bf16 greedy tokens may part from
the engine it would replace (the GPU candidates' tests use it), on hand-made results whose answer is known."""

from __future__ import annotations

import pytest

from rollout_lib.backends.base import RequestResult
from rollout_lib.checks.conformance import greedy_divergences_beyond_ties

TIE = 0.25


def _result(tokens, logprobs, request_id="q0s0"):
    return RequestResult(request_id, tuple(tokens), "length", tuple(logprobs), "identity")


REFERENCE = _result([5, 6, 7, 8], [-0.10, -0.70, -0.69, -0.05])
MARGINS = [3.0, 0.10, 2.0, 4.0]  # the reference's own top-1 minus top-2 logit, per position: a tie at 1


@pytest.mark.parametrize(("candidate", "expected"), [
    (_result([5, 6, 7, 8], [-0.11, -0.72, -0.69, -0.06]), []),                     # same tokens, logprobs close
    (_result([5, 9, 9, 9], [-0.12, -0.74, -0.20, -0.30]), []),                     # parts at the tie (position 1)
    (_result([5, 6, 9, 9], [-0.10, -0.70, -0.80, -0.30]),                          # parts where it was sure
     ["q0s0: tokens part at position 2 (reference 7, candidate 9) where the reference's top-1 minus top-2 logit "
      "is 2.000, not below 0.25"]),
    (_result([5, 6, 7, 8], [-0.10, -0.70, -0.69, -0.90]),                          # same tokens, a logprob drifted
     ["q0s0: sampled log-probability 0.850 from the reference's at position 3, before any divergence (bound 0.25)"]),
    (_result([5, 9, 9, 9], [-0.60, -0.74, -0.20, -0.30]),                          # drift before the tie
     ["q0s0: sampled log-probability 0.500 from the reference's at position 0, before any divergence (bound 0.25)"]),
    (_result([5, 6, 7, 8, 1], [-0.1, -0.7, -0.69, -0.05, -0.3]),                   # went on where it stopped
     ["q0s0: the reference stopped after 4 tokens, the candidate after 5, identical up to there"]),
])
def test_a_candidate_may_part_from_the_reference_only_at_a_near_tie(candidate, expected):
    assert greedy_divergences_beyond_ties([REFERENCE], [candidate], [MARGINS], TIE) == expected


def test_results_without_logprobs_or_out_of_order_are_not_passed():
    bare = RequestResult("q0s0", (5, 6, 7, 8), "length", None, "identity")
    assert greedy_divergences_beyond_ties([REFERENCE], [bare], [MARGINS], TIE) == [
        "q0s0: no log-probabilities to compare"]
    with pytest.raises(ValueError, match="request 'q1s0' compared with 'q0s0'"):
        greedy_divergences_beyond_ties([REFERENCE], [_result([5], [-0.1], "q1s0")], [MARGINS], TIE)
