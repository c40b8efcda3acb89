"""Starting ranks and knowing who they are: the environment (torchrun, Slurm), local spawn, sbatch scripts, watchdogs, device memory."""
