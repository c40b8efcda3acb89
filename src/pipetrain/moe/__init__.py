"""Mixture-of-experts mechanics that no model family owns: router statistics carried across stages, the
load-balancing loss they give, and the bias balancing of auxiliary-loss-free routers (docs/moe.md); expert
parallelism's token dispatch and combine, and experts split over the expert-parallel ranks (docs/moe-ep.md)."""
