"""One training job: its description (`TrainConfig`), the checks before any rank starts, and each rank's loop."""
