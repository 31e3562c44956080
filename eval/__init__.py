"""Evaluation: harness (policy grid x workload), metrics, reports, benchmarks and the CLI."""
