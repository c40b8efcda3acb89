"""BatchNorm under pipelining: running statistics that a recomputed forward does not move, deferred to one update per
step over every micro-batch (torchgpipe's `deferred_batch_norm`), and shared by the data-parallel replicas.

`StageNorms` holds the batch norms of one stage module (`stage.py`); `DeferredStatistics` accumulates one batch
norm's statistics over a step's micro-batches and commits them once (`deferred.py`). docs/batchnorm.md tells the
whole story.
"""

from pipetrain.batchnorm.deferred import DeferredStatistics
from pipetrain.batchnorm.stage import StageNorms, share_statistics

__all__ = ["DeferredStatistics", "StageNorms", "share_statistics"]
