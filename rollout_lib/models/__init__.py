"""The models the study names: synthetic snapshots and payload digests, logit-scale calibration, the
NF4 + LoRA actor and its exact BF16 mirror, and the deterministic policy versions."""
