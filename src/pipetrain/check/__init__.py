"""`pipetrain check`, the numerical doctor: does a layout train like the unsplit model? (see docs/check.md)"""

from pipetrain.check.findings import TOLERANCES, CheckReport, Hazard, Tolerances
from pipetrain.check.run import DEFAULT_LR, DEFAULT_STEPS, run_check, run_checks

__all__ = ["run_check", "run_checks", "CheckReport", "Hazard", "Tolerances", "TOLERANCES", "DEFAULT_STEPS",
           "DEFAULT_LR"]
