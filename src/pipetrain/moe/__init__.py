"""Mixtures of experts: token dispatch and combine over the expert-parallel ranks, experts split over them."""
