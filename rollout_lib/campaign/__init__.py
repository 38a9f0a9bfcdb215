"""Campaigns: the preregistered workload measured over many GPU leases. The schedule (cost estimates,
longest-first over GPUs, deadline-bounded) and the driver (one measuring process per GPU, detached,
with a status a later command can read)."""
