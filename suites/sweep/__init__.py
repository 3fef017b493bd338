"""`specbench sweep`: throughput and latency of engine arms across load levels, with a noise floor.

Pipeline: `Workload` (workload.py: bundled data sets or random text, tokenized once per engine) ->
`SweepRunner` (runner.py: closed-loop concurrency or open-loop arrivals, warm-up excluded, rounds
interleaved across arms, the baseline run twice for the paired noise floor, every record to the
store as it happens) -> records -> `metrics` (per request and per cell, REFERENCE.md section 3) and
`compare` (median paired ratios, the noise floor). `run_sweep` (session.py) does it end to end from
engine strings; suites/report renders the records. Every cell is also written in vLLM bench's result
format (vllm_format.py), and vllm_import.py reads such files back into the store.
"""

from .compare import noise_floor, paired_ratios, resolved, speedup
from .metrics import acceptance, cell_stats, derive, request_record, summary
from .runner import Arm, SweepConfig, SweepRunner, arrival_offsets, schedule, with_noise_copy
from .session import SweepOutcome, arm_labels, run_sweep, split_arms
from .workload import DATASETS, Workload, WorkloadError

__all__ = [
    "DATASETS", "Arm", "SweepConfig", "SweepOutcome", "SweepRunner", "Workload", "WorkloadError", "acceptance",
    "arm_labels", "arrival_offsets", "cell_stats", "derive", "noise_floor", "paired_ratios", "request_record",
    "resolved", "run_sweep", "schedule", "speedup", "split_arms", "summary", "with_noise_copy",
]
