"""Measurement: the runner (warmup, repetitions, invalidation, resumable raw files), the synchronized
phase timer, torch and NVML memory, and the environment identity a raw file is bound to."""
