"""Planning: a pure simulator of pipeline schedules, memory and communication, and the layout search on top."""
