"""Campaigns: the preregistered workload measured over many GPU jobs. The schedule (cost estimates,
longest-first over GPUs, deadline-bounded), the executors (local: one GPU, no Ray; ray: one worker per GPU
of a Ray cluster) and the driver (one measuring process per GPU, detached, with a status a later command
can read)."""
