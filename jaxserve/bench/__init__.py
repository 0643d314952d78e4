"""`jaxserve bench`: serving benchmarks (workloads, runners, metrics, reports)."""
