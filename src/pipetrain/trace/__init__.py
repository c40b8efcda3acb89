"""Timelines of pipeline runs: spans per rank, a Chrome/Perfetto trace, a Gantt chart and the measured bubble."""
