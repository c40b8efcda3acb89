echo "slurm-up: placeholder during setup"
