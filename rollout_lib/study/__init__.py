"""The study: what is measured. Preregistration (strict YAML loader), the Qwen3 architectures, the
workload's cells and token prompts, seeded streams. Depends on nothing above it."""
