"""Logs people read: step, evaluation and epoch records, their sinks (console line, `steps.jsonl`, TensorBoard), the
run log that fans records out, and MFU arithmetic."""

from pipetrain.logs.config import LogConfig, default_run_dir
from pipetrain.logs.mfu import ModelFlops, mfu, peak_tflops
from pipetrain.logs.records import EpochReport, EvalRecord, MetricTotals, StepRecord, record_dict, report_dicts

__all__ = ["LogConfig", "default_run_dir", "ModelFlops", "mfu", "peak_tflops", "EvalRecord", "StepRecord",
           "record_dict", "EpochReport", "MetricTotals", "report_dicts"]
