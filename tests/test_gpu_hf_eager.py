"""GPU-marked: hf_cached's eager path (transformers + peft, one torch.Generator per request) against the
oracle, float32, full-size synthetic actor.

Its own module because every backend caps its process at the preregistered 16 GiB budget: the float32
oracle, the float32 graphs engine and the float32 eager mirror do not fit in it together, so this module
holds only the oracle and the eager path (test_gpu_hf.py's pair is torn down at its module's end).
"""

from __future__ import annotations

import pytest

from rollout_lib.models.policy import policy_versions
from rollout_lib.study.workload import Workload

from .conftest import started_backends

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_part1]  # docs/reliability.md: GPU suite parts


@pytest.fixture(scope="module")
def oracle_and_eager(prereg_study):
    policy = policy_versions(Workload(prereg_study).arch, prereg_study.actor.lora,
                             prereg_study.actor.payload_digest, 1)[0]
    pair = started_backends(prereg_study, policy, (("hf_reference", "hf_reference", {}),
                                                   ("hf_cached", "hf_cached", {"decode": "eager"})),
                            device="cuda", compute_dtype="float32")
    yield pair
    for backend in pair.values():
        backend.teardown()


def test_float32_seeded_samples_eager_equal_the_oracle_full_size(prereg_study, oracle_and_eager):
    """The eager path uses the oracle's own sampler, so its seeded tokens must equal the oracle's, whatever
    the partition. The default graphs path draws counter-based noise instead (DESIGN.md decision 10)."""
    work = Workload(prereg_study)
    cell = work.cell("p128-r64-n1-stochastic")
    requests = work.requests(cell)
    eager_backend = oracle_and_eager["hf_cached"]
    assert eager_backend.environment()["decode"] == "eager"
    reference = oracle_and_eager["hf_reference"].generate(requests)
    eager = eager_backend.generate(requests)
    assert [r.token_ids for r in reference.results] == [r.token_ids for r in eager.results]
    split = [r for batch in work.partition_batches(cell, (1, 1, 1, 1)) for r in eager_backend.generate(batch).results]
    assert [r.token_ids for r in split] == [r.token_ids for r in eager.results]
