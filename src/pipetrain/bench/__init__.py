"""`pipetrain bench`: the Pipe benchmark's grid (stages × batch × chunks), each cell isolated, its time and memory, the reports; and the calibration of this machine for the planner."""
