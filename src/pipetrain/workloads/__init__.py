"""What to train: the registry of workloads (model, data, loss, metrics), import-path workloads, and one room per built-in workload."""
