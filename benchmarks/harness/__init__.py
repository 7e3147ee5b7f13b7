"""The shared pieces of the benchmarks: launcher, sampler, plan, report writer, workload."""
