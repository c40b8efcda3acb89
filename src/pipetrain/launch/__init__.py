"""pipetrain."""
