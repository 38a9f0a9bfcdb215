"""Checks that produce evidence beside the measurements: conformance (exactness against the oracle)
and policy refresh (eight versions, identities, memory, teardown)."""
