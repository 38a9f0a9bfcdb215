"""The raw files' environment names the host CPU; continuing a cell does not depend on it."""

from __future__ import annotations

from rollout_lib.measure.identity import environment_identity, identity_key


def test_environment_records_the_host_cpu_outside_the_measurement_identity():
    environment = environment_identity(model_digests={"actor": "ab"}, preregistration_sha256="cd")
    host = environment["host"]
    assert host["logical_cpus"] >= 1 and host["cpu_model"]
    other = environment | {"host": {"cpu_model": "another CPU", "logical_cpus": 2}}
    assert identity_key(other, "code") == identity_key(environment, "code")
