"""Benchmarks: workloads, kvserve runs and the peers it is measured against, reports."""
